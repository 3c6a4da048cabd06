"""Transformer Engine interop: TE's recipe classes, TE's autocast, and what of TE is installed.

TE is optional. Its pure-Python package (``pip install transformer-engine``) holds the recipe
classes, but ``import transformer_engine`` raises ``RuntimeError`` on a machine without TE's
compiled core (a CPU machine, or the Python wheel without ``transformer_engine_cu12``/``_torch``).
The recipe file itself, ``transformer_engine/common/recipe/__init__.py``, needs only ``pydantic``,
so :func:`te_recipe_module` falls back to loading that one file by path under a private module
name. Nothing here raises at import time, and nothing imports TE's PyTorch extension unless the
user already did (:func:`autocast_recipe` only looks at ``sys.modules``).

Recipe conversion is by TE class *name* (``type(obj).__name__`` with a module under
``transformer_engine``), so a recipe object converts whichever copy of the recipe module made it.
Fields that change what the expert GEMMs compute must be honoured or refused; fields that only
concern attention (``fp8_dpa``, ``fp8_mha``) or Hopper/Ada split accumulation, which TE itself
requires to be on for block scaling, are not recorded in our recipes (see ``_IGNORED_FIELDS``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Dict, Optional

from . import recipes as ours

_TE_RECIPE_CLASSES = (
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
)
_PRIVATE_RECIPE_MODULE = "_te_fused_moe_te_recipe"

# TE fields that do not change the expert MLP's numbers (attention-only switches). They are not
# stored in our recipes; recipe_to_te leaves them at TE's defaults.
_IGNORED_FIELDS = ("fp8_dpa", "fp8_mha")

# Why a TE recipe cannot run here, and what to use instead.
_UNSUPPORTED = {
    "DelayedScaling": "per-tensor scaling",
    "Float8CurrentScaling": "per-tensor scaling",
    "CustomRecipe": "user-supplied quantizer factories",
}
_INSTEAD = (
    "use MXFP8BlockScaling, NVFP4BlockScaling or Float8BlockScaling "
    "(TE's or te_fused_moe.recipes'), or one of the names 'bf16', 'mxfp8', 'nvfp4', 'fp8_block'"
)


# --------------------------------------------------------------------------- locating TE

def _te_package_dir() -> Optional[str]:
    """Directory of the installed ``transformer_engine`` package, found without executing it."""
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def te_version() -> Optional[str]:
    """Installed TE version from package metadata (``transformer-engine``), or None."""
    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_recipe_normally() -> ModuleType:
    return importlib.import_module("transformer_engine.common.recipe")


def _load_recipe_by_path(package_dir: str) -> ModuleType:
    path = os.path.join(package_dir, "common", "recipe", "__init__.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no recipe file at {path}")
    spec = importlib.util.spec_from_file_location(_PRIVATE_RECIPE_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    # pydantic dataclasses resolve annotations through sys.modules[cls.__module__].
    sys.modules[_PRIVATE_RECIPE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_PRIVATE_RECIPE_MODULE, None)
        raise
    return module


@functools.lru_cache(maxsize=1)
def _recipe_module_and_how():
    """(module or None, how it was obtained or why not). Cached: TE is looked for once."""
    package_dir = _te_package_dir()
    if package_dir is None:
        return None, "transformer_engine is not installed"
    try:
        return _import_recipe_normally(), "import transformer_engine.common.recipe"
    except Exception as error:  # TE raises RuntimeError/OSError without its compiled core
        import_error = f"{type(error).__name__}: {error}"
    try:
        return _load_recipe_by_path(package_dir), f"loaded by file path (normal import failed: {import_error})"
    except Exception as error:
        return None, f"normal import failed ({import_error}); loading by path failed ({type(error).__name__}: {error})"


def te_recipe_module() -> Optional[ModuleType]:
    """TE's real recipe module (``transformer_engine.common.recipe``), or None if TE is absent.

    A normal import when TE imports; otherwise the installed package's recipe file loaded by path.
    """
    return _recipe_module_and_how()[0]


# --------------------------------------------------------------------------- recipe conversion

def _te_class_name(obj: Any) -> Optional[str]:
    cls = type(obj)
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if klass.__name__ in _TE_RECIPE_CLASSES and (
            module.startswith("transformer_engine") or module == _PRIVATE_RECIPE_MODULE
        ):
            return klass.__name__
    return None


def is_te_recipe(obj: Any) -> bool:
    """Whether ``obj`` is one of TE's recipe objects (any TE recipe class, supported or not)."""
    if isinstance(obj, (type, ours.Recipe)) or obj is None:
        return False
    if _te_class_name(obj) is not None:
        return True
    module = te_recipe_module()
    return module is not None and isinstance(obj, module.Recipe)


def _format_from_te(te_format: Any, recipe_name: str) -> ours.Format:
    name = getattr(te_format, "name", None)
    if name not in ("E4M3", "E5M2", "HYBRID"):
        raise ValueError(f"recipe: TE's {recipe_name}.fp8_format={te_format!r} has no te_fused_moe equivalent")
    return ours.Format[name]


def _refuse_non_default(te_recipe: Any, recipe_name: str, field: str, default: Any, why: str) -> None:
    value = getattr(te_recipe, field, default)
    if value != default:
        raise ValueError(
            f"recipe: TE's {recipe_name}.{field}={value!r} is not supported by te_fused_moe ({why}); "
            f"set it to {default!r}"
        )


# TE's Float8BlockScaling quantizers take their scale rounding and amax epsilon from these
# QParams (class attributes of TE's recipe, fixed when its module is imported), not from
# ``use_f32_scales``; ours has one switch for all three roles and no epsilon.
_BLOCK_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def _refuse_block_qparams_we_cannot_honour(te_recipe: Any, recipe_name: str) -> None:
    """Refuse QParams we cannot follow, and a ``use_f32_scales`` that TE's quantizers would not
    follow either (they read the QParams, which TE fixes when its module is imported)."""
    power_2 = {}
    for field in _BLOCK_QPARAMS:
        qparams = getattr(te_recipe, field, None)
        if qparams is None:
            continue
        epsilon = float(getattr(qparams, "amax_epsilon", 0.0))
        if epsilon != 0.0:
            raise ValueError(
                f"recipe: TE's {recipe_name}.{field}.amax_epsilon={epsilon!r} is not supported by te_fused_moe "
                "(block amaxes are used as they are); set it to 0.0"
            )
        power_2[field] = bool(getattr(qparams, "power_2_scale", True))
    if len(set(power_2.values())) > 1:
        odd = min(power_2, key=lambda f: list(power_2.values()).count(power_2[f]))
        raise ValueError(
            f"recipe: TE's {recipe_name}.{odd}.power_2_scale={power_2[odd]} differs from the other roles "
            f"({power_2}); te_fused_moe rounds the scales of every role alike (use_f32_scales)"
        )
    use_f32_scales = bool(getattr(te_recipe, "use_f32_scales", False))
    if power_2 and next(iter(power_2.values())) == use_f32_scales:
        raise ValueError(
            f"recipe: TE's {recipe_name}.use_f32_scales={use_f32_scales} but its QParams say "
            f"power_2_scale={use_f32_scales}, and TE's quantizers follow the QParams; make them agree "
            "(TE sets both from NVTE_FP8_BLOCK_SCALING_FP32_SCALES at import) so that te_fused_moe computes "
            "the scales TE would"
        )


def recipe_from_te(te_recipe: Any) -> ours.Recipe:
    """Our recipe equal to TE recipe ``te_recipe``; ``ValueError`` for what we cannot honour."""
    name = _te_class_name(te_recipe)
    if name is None:
        raise TypeError(f"recipe: expected a Transformer Engine recipe, got {type(te_recipe).__name__}")
    if name in _UNSUPPORTED:
        raise ValueError(f"recipe: TE's {name} ({_UNSUPPORTED[name]}) is not supported by te_fused_moe; {_INSTEAD}")
    _refuse_non_default(
        te_recipe, name, "backward_override", None,
        "the backward pass always uses the recipe's quantized operands",
    )
    if name == "MXFP8BlockScaling":
        _refuse_non_default(te_recipe, name, "enable_2d_quantization", False, "weights use 1x32 blocks")
        return ours.MXFP8BlockScaling(
            fp8_format=_format_from_te(te_recipe.fp8_format, name), margin=int(te_recipe.margin)
        )
    if name == "NVFP4BlockScaling":
        _refuse_non_default(
            te_recipe, name, "row_scaled_activation", False, "activations use one global FP32 scale per tensor"
        )
        _refuse_non_default(te_recipe, name, "nvfp4_4over6", "none", "block scales are chosen by amax/6 only")
        for field in ("fp4_format", "fp8_format"):
            expected = "E2M1" if field == "fp4_format" else "E4M3"
            if getattr(getattr(te_recipe, field, None), "name", expected) != expected:
                raise ValueError(f"recipe: TE's {name}.{field} must be {expected} for te_fused_moe")
        # nvfp4_4over6_e4m3_use_256 / _err_mode only matter when 4over6 is on, which is refused above.
        return ours.NVFP4BlockScaling(
            disable_rht=bool(te_recipe.disable_rht),
            disable_stochastic_rounding=bool(te_recipe.disable_stochastic_rounding),
            disable_2d_quantization=bool(te_recipe.disable_2d_quantization),
        )
    if name == "Float8BlockScaling":
        for phase in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            params = getattr(te_recipe, phase, None)
            if params is not None and not getattr(params, "use_split_accumulator", True):
                raise ValueError(f"recipe: TE's {name}.{phase}.use_split_accumulator=False is not supported")
        _refuse_block_qparams_we_cannot_honour(te_recipe, name)
        return ours.Float8BlockScaling(
            fp8_format=_format_from_te(te_recipe.fp8_format, name),
            x_block_scaling_dim=int(te_recipe.x_block_scaling_dim),
            w_block_scaling_dim=int(te_recipe.w_block_scaling_dim),
            grad_block_scaling_dim=int(te_recipe.grad_block_scaling_dim),
            use_f32_scales=bool(te_recipe.use_f32_scales),
        )
    raise ValueError(f"recipe: TE's {name} is not supported by te_fused_moe; {_INSTEAD}")  # pragma: no cover


def _require_te_recipe_module() -> ModuleType:
    module = te_recipe_module()
    if module is None:
        raise RuntimeError(
            "recipe_to_te: Transformer Engine's recipe module is not available "
            f"({_recipe_module_and_how()[1]}); install transformer-engine (and pydantic)"
        )
    return module


def recipe_to_te(recipe: Any) -> Any:
    """TE's recipe object equal to our ``recipe`` (an object or a name). ``None`` for BF16
    (TE expresses "no quantization" by not entering autocast)."""
    recipe = ours.as_recipe(recipe)
    if isinstance(recipe, ours.BF16Recipe):
        return None
    te = _require_te_recipe_module()
    if isinstance(recipe, ours.MXFP8BlockScaling):
        return te.MXFP8BlockScaling(
            margin=recipe.margin, fp8_format=te.Format[recipe.fp8_format.name],
            backward_override=None, enable_2d_quantization=False,
        )
    if isinstance(recipe, ours.NVFP4BlockScaling):
        return te.NVFP4BlockScaling(
            disable_rht=recipe.disable_rht,
            disable_stochastic_rounding=recipe.disable_stochastic_rounding,
            disable_2d_quantization=recipe.disable_2d_quantization,
            row_scaled_activation=False, nvfp4_4over6="none", backward_override=None,
        )
    if isinstance(recipe, ours.Float8BlockScaling):
        te_recipe = te.Float8BlockScaling(
            use_f32_scales=recipe.use_f32_scales,
            fp8_format=te.Format[recipe.fp8_format.name],
            x_block_scaling_dim=recipe.x_block_scaling_dim,
            w_block_scaling_dim=recipe.w_block_scaling_dim,
            grad_block_scaling_dim=recipe.grad_block_scaling_dim,
            backward_override=None,
        )
        # TE's quantizers read these, not use_f32_scales (see _BLOCK_QPARAMS)
        for field in _BLOCK_QPARAMS:
            setattr(te_recipe, field, te.QParams(power_2_scale=not recipe.use_f32_scales, amax_epsilon=0.0))
        return te_recipe
    raise TypeError(f"recipe_to_te: no TE equivalent for {type(recipe).__name__}")


# --------------------------------------------------------------------------- TE's autocast

def _global_state_manager() -> Optional[Any]:
    """TE's FP8GlobalStateManager if TE's PyTorch extension is *already imported*, else None.

    If the user never imported ``transformer_engine.pytorch`` they cannot be inside its autocast,
    so there is no reason to pay for (or risk) importing it here.
    """
    if "transformer_engine.pytorch" not in sys.modules:
        return None
    for module_name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        module = sys.modules.get(module_name)
        manager = getattr(module, "FP8GlobalStateManager", None) if module is not None else None
        if manager is not None:
            return manager
    return None


def autocast_recipe() -> Optional[ours.Recipe]:
    """Our recipe converted from TE's active ``autocast``/``fp8_autocast`` recipe, else None."""
    manager = _global_state_manager()
    if manager is None or not manager.is_fp8_enabled():
        return None
    return recipe_from_te(manager.get_fp8_recipe())


# --------------------------------------------------------------------------- status for the CLI

def _pytorch_extension_status() -> Dict[str, Any]:
    if "transformer_engine.pytorch" in sys.modules:
        return {"imports": True, "why_not": ""}
    if _te_package_dir() is None:
        return {"imports": False, "why_not": "transformer_engine is not installed"}
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:
        return {"imports": False, "why_not": f"{type(error).__name__}: {error}".strip()[:500]}
    return {"imports": True, "why_not": ""}


def te_status(check_pytorch: bool = True) -> Dict[str, Any]:
    """What of TE is usable here, for ``te-fused-moe env``.

    ``check_pytorch=True`` tries to import TE's PyTorch extension (slow where TE is installed;
    it never raises here).
    """
    module, how = _recipe_module_and_how()
    status: Dict[str, Any] = {
        "version": te_version(),
        "package_dir": _te_package_dir(),
        "recipes_load": module is not None,
        "recipes_how": how,
    }
    if check_pytorch:
        pytorch = _pytorch_extension_status()
        status["pytorch_imports"] = pytorch["imports"]
        status["pytorch_why_not"] = pytorch["why_not"]
    return status


__all__ = [
    "te_recipe_module",
    "te_version",
    "is_te_recipe",
    "recipe_from_te",
    "recipe_to_te",
    "autocast_recipe",
    "te_status",
]
