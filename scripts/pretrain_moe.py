#!/usr/bin/env python
"""Pretrain a Megatron Core GPT model with MoE layers, experts chosen by --moe-grouped-gemm-impl.

    python scripts/pretrain_moe.py --config configs/cpu_tiny.yaml --moe-grouped-gemm-impl fused \
        --train-iters 20 --device cpu --out runs/cpu_tiny_fused

Everything comes from the megatron-core wheel (no megatron.training): parallel_state (gloo on
CPU, NCCL on GPU; one process, or a torchrun launch), ``GPTModel`` with Megatron's decoder block spec, experts picked by
``megatron_patches.install()`` from ``moe_grouped_gemm_impl``, Megatron's ``MockGPTDataset``
through ``BlendedMegatronDatasetBuilder`` (falls back to synthetic tokens, logged, if the dataset
cannot be built), and Megatron's optimizer (``get_megatron_optimizer`` over a Megatron DDP
wrapper; without TE/Apex Megatron itself falls back to torch's Adam(W)).

Writes ``<out>/log.json`` (config, versions, per-step loss, tokens/s, step time, MoE-layer
forward+backward time) and, with --plot, ``<out>/loss.png``. Timing synchronizes the GPU once per
step for the log only; the experts themselves never sync.

Expert parallelism: ``torchrun --nproc-per-node N scripts/pretrain_moe.py ... --expert-model-parallel-size
EP``. On GPUs each data-parallel rank trains on its own batches through Megatron DDP (not run here:
no multi-GPU machine yet). On CPU (gloo) the run is a correctness harness: every rank trains on the
same batches and :func:`reduce_replicated_grads` makes each step equal the single-process step; with
``--global-init`` (initial weights independent of how experts are sharded) the loss curve equals the
one-process run's (``tests/test_pretrain_cpu.py``).

``--cuda-graph {none,local,full_iteration}`` (GPU only; see ``megatron_patches.cuda_graph``):
``local`` turns on Megatron's per-layer graphs, ``full_iteration`` replays forward+backward of the
whole step from one graph; compare ``tokens_per_s_after_warmup`` with and without.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402

ACTIVATIONS = ("swiglu", "geglu", "gpt_oss_swiglu", "srelu")
CUDA_GRAPH_MODES = ("none", "local", "full_iteration")  # = megatron_patches.cuda_graph.MODES (checked in tests)
FULL_ITERATION_WARMUP_STEPS = 2  # eager steps before the whole-step graph is captured


def positive_int(text: str) -> int:
    """argparse type of the count flags: 0 would otherwise fall back to the config's value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv=None):
    from megatron_patches.arguments import add_megatron_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML model config (configs/*.yaml)")
    parser.add_argument("--train-iters", type=positive_int, default=None, help="iterations (default: the config's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default=None, help="output folder (default runs/<config>_<impl>)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    parser.add_argument("--moe-timing-iters", type=positive_int, default=None, help="MoE layer fwd+bwd timing repeats")
    parser.add_argument("--plot", action="store_true", help="also write loss.png (matplotlib)")
    parser.add_argument("--cuda-graph", choices=CUDA_GRAPH_MODES, default="none",
                        help="CUDA graphs (needs CUDA): Megatron's per-layer graphs ('local') or one graph of "
                             "the whole forward+backward ('full_iteration'); default none")
    parser.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                        help="drop-and-pad MoE: each expert takes capacity-factor x its even share of tokens "
                             "(moe_pad_expert_input_to_capacity). Megatron's dispatchers read the routing on "
                             "the host unless the shapes are fixed this way, which whole-step graphs need. "
                             "Default: dropless")
    parser.add_argument("--expert-model-parallel-size", type=positive_int, default=1,
                        help="expert parallelism (Megatron's flag): experts sharded over this many ranks of a "
                             "torchrun launch (world size a multiple of it). GPU: Megatron DDP, each data-parallel "
                             "rank its own batches. CPU (gloo): every rank trains on the same batches and the "
                             "gradients are reduced so that the run equals the single-process run step for step "
                             "(a correctness harness for the expert-parallel path)")
    parser.add_argument("--global-init", action="store_true",
                        help="re-initialise every weight from a generator seeded by its name (fused experts: by their "
                             "global index): the same initial model for any --expert-model-parallel-size (compares "
                             "expert-parallel runs with the single-process run)")
    add_megatron_args(parser)  # --moe-grouped-gemm-impl, same flag as with Megatron-LM
    return parser.parse_args(argv)


def activation_settings(name: str) -> dict:
    """Megatron config fields for an activation name of our configs."""
    if name == "swiglu":
        return dict(activation_func=F.silu, gated_linear_unit=True)
    if name == "geglu":
        return dict(activation_func=F.gelu, gated_linear_unit=True)
    if name == "gpt_oss_swiglu":
        from megatron.core.activations import quick_gelu

        return dict(activation_func=quick_gelu, gated_linear_unit=True, glu_linear_offset=1.0,
                    activation_func_clamp_value=7.0)
    if name == "srelu":
        from megatron.core.activations import squared_relu

        return dict(activation_func=squared_relu, gated_linear_unit=False)
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")


def init_distributed(device: torch.device, expert_parallel: int = 1) -> None:
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="pretrain_moe_"), "store")
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    init_method=f"file://{store}", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    world = dist.get_world_size()
    if world % expert_parallel:
        raise ValueError(f"--expert-model-parallel-size: expected a divisor of the world size ({world} processes; "
                         f"launch with torchrun --nproc-per-node), got {expert_parallel}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=expert_parallel)


def build_config(model: dict, impl: str, device: torch.device, extra_fields: dict = None):
    from megatron_patches import FusedMoETransformerConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fields = dict(
        num_layers=model["num_layers"], hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        num_query_groups=model.get("num_query_groups"),
        ffn_hidden_size=model.get("ffn_hidden_size", model["moe_ffn_hidden_size"]),
        num_moe_experts=model["num_moe_experts"], moe_ffn_hidden_size=model["moe_ffn_hidden_size"],
        moe_router_topk=model["moe_router_topk"],
        moe_router_score_function=model.get("moe_router_score_function", "softmax"),
        moe_router_pre_softmax=model.get("moe_router_pre_softmax", False),
        moe_shared_expert_intermediate_size=model.get("moe_shared_expert_intermediate_size"),
        moe_layer_freq=model.get("moe_layer_freq", 1),
        moe_aux_loss_coeff=model.get("moe_aux_loss_coeff", 1e-2),
        moe_token_dispatcher_type=model.get("moe_token_dispatcher_type", "alltoall"),
        moe_grouped_gemm=impl != "sequential",
        moe_grouped_gemm_impl=impl,
        add_bias_linear=model.get("add_bias_linear", False),
        normalization=model.get("normalization", "RMSNorm"),
        qk_layernorm=model.get("qk_layernorm", False),
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        init_method_std=model.get("init_method_std", 0.02),
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_activation_fusion=False,
    )
    fields.update(activation_settings(model.get("activation", "swiglu")))
    fields.update(extra_fields or {})
    return FusedMoETransformerConfig(**fields)


def capacity_fields(capacity_factor) -> dict:
    """Config fields for --moe-expert-capacity-factor (drop-and-pad), none when dropless."""
    if capacity_factor is None:
        return {}
    if not capacity_factor > 0:
        raise ValueError(f"--moe-expert-capacity-factor: expected a positive number, got {capacity_factor}")
    return dict(moe_expert_capacity_factor=float(capacity_factor), moe_pad_expert_input_to_capacity=True)


def build_model(config, model: dict, device: torch.device):
    import megatron_patches
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    megatron_patches.install()  # MoELayer builds the experts named by config.moe_grouped_gemm_impl
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=model["vocab_size"],
                   max_sequence_length=model["seq_length"], position_embedding_type="rope")
    return gpt.to(device)


class _MockTokenizer:
    """What MockGPTDataset reads from a tokenizer (no files, no downloads)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = vocab_size - 2
        self.unique_identifiers = {"class": "pretrain_moe mock", "vocab_size": vocab_size}

    def tokenize(self, text):  # never called for mock data
        raise NotImplementedError

    def detokenize(self, ids):
        raise NotImplementedError


def batches(model: dict, iters: int, seed: int, device: torch.device, data_rank: int = 0, data_ranks: int = 1):
    """(tokens, labels, loss_mask, position_ids, source) per step: Megatron's MockGPTDataset, else synthetic.
    With ``data_ranks`` > 1 the samples of a step are split over the data-parallel ranks."""
    batch, seq = model["micro_batch_size"], model["seq_length"]
    samples = iters * batch * data_ranks
    try:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

        ds_config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq, split="1,0,0", tokenizer=_MockTokenizer(model["vocab_size"]),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            create_attention_mask=False, path_to_cache=None, mmap_bin_files=False,
        )
        train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [samples, None, None], lambda: True,
                                                    ds_config).build()
        source = "megatron.core.datasets MockGPTDataset"

        def get(i):
            item = train[i]
            return item["tokens"], item["labels"], item["loss_mask"], item["position_ids"]
    except Exception as exc:  # noqa: BLE001 - documented fallback, reason logged
        generator = torch.Generator().manual_seed(seed)
        data = torch.randint(0, model["vocab_size"], (samples, seq + 1), generator=generator)
        source = f"synthetic tokens (MockGPTDataset unavailable: {type(exc).__name__}: {exc})"

        def get(i):
            return data[i, :-1], data[i, 1:], torch.ones(seq), torch.arange(seq)

    def stack(step):
        items = [get((step * data_ranks + data_rank) * batch + j) for j in range(batch)]
        return [torch.stack([torch.as_tensor(item[k]) for item in items]).to(device) for k in range(4)]

    return source, stack


class Trainer:
    """Model + optimizer step. GPU: Megatron DDP + ``get_megatron_optimizer`` (mixed precision).
    CPU: Megatron's ``FP32Optimizer`` allocates on CUDA, so the model is stepped by the optimizer
    class ``megatron.core.optimizer`` exports (torch's AdamW when TE/Apex are absent) with the
    same settings (Adam, no weight decay, grad-norm clip 1.0)."""

    def __init__(self, gpt, lr: float, config, device: torch.device):
        self.clip = 1.0
        if device.type == "cuda":
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            self.model = DistributedDataParallel(
                config, DistributedDataParallelConfig(use_distributed_optimizer=False), gpt)
            opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=self.clip,
                                         bf16=config.bf16, params_dtype=config.params_dtype)
            self.optimizer = get_megatron_optimizer(opt_config, [self.model])
            inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])[0]
            self.description = (f"megatron.core.optimizer.get_megatron_optimizer -> {type(inner).__name__} "
                                f"over torch {type(inner.optimizer).__name__}")
            self.megatron = True
        else:
            from megatron.core import optimizer as mcore_optimizer

            self.model = gpt
            self.optimizer = mcore_optimizer.Adam(gpt.parameters(), lr=lr, weight_decay=0.0)
            self.description = (f"megatron.core.optimizer.Adam = {type(self.optimizer).__module__}."
                                f"{type(self.optimizer).__name__} (Megatron's fallback without TE/Apex)")
            self.megatron = False
        # CPU with several ranks: all ranks train on the same batches (see reduce_replicated_grads)
        self.replicated = device.type == "cpu" and dist.is_initialized() and dist.get_world_size() > 1

    def zero_grad(self):
        if self.megatron:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self):
        """Returns (update applied, grad norm)."""
        if self.megatron:
            self.model.finish_grad_sync()
            ok, grad_norm, _ = self.optimizer.step()
            return bool(ok), None if grad_norm is None else float(grad_norm)
        if self.replicated:
            grad_norm = reduce_replicated_grads(self.model, self.clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return True, float(grad_norm)


def global_init(gpt, config, seed: int) -> None:
    """Re-initialise every weight matrix from its own generator, seeded by (seed, parameter name) and,
    for fused experts, by the expert's global index, with Megatron's init std (the scaled std for the
    layers that write into the residual stream: attention ``linear_proj``, MLP and expert ``linear_fc2``).
    Construction order decides which random numbers each weight gets, and sharding experts over ranks
    changes that order (a rank draws only its own experts, and every weight built after them moves);
    this makes the initial model the same for any expert-parallel size. Norm weights and biases are
    constants already."""
    import zlib

    from megatron_patches.experts import FusedExpertsMLP, group_rank

    std = config.init_method_std
    scaled = std / math.sqrt(2.0 * config.num_layers)
    std_of = lambda name: scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
    gen = lambda *key: torch.Generator().manual_seed(zlib.crc32(repr((seed,) + key).encode()))
    experts = {id(p): m for m in gpt.modules() if isinstance(m, FusedExpertsMLP)
               for p in (m.linear_fc1.weight, m.linear_fc2.weight)}
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if p.dim() < 2:
                continue
            if id(p) in experts:  # [local experts, ...]: one generator per global expert
                module = experts[id(p)]
                first = group_rank(module.ep_group) * module.num_local_experts
                for i in range(p.shape[0]):
                    p[i].copy_(torch.randn(p[i].shape, generator=gen(name, first + i)) * std_of(name))
            else:
                p.copy_(torch.randn(p.shape, generator=gen(name)) * std_of(name))

def reduce_replicated_grads(model, clip: float) -> float:
    """The CPU expert-parallel harness: every rank ran the same batch, so the step must equal the
    single-process step. Dense gradients are averaged over the ranks (they are equal; this keeps the
    replicas in sync). An expert's gradient summed the same tokens once per rank of its expert-parallel
    group (each sent it its copy), so it is divided by that group's size, then averaged over the
    expert's replicas (expert data parallel). Then the global gradient norm (each parameter counted
    once) clips as ``clip_grad_norm_`` would in one process. Returns that norm."""
    from megatron.core import parallel_state

    world = dist.get_world_size()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    expert_dp = parallel_state.get_expert_data_parallel_group()
    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "allreduce", True):
            dist.all_reduce(p.grad)
            p.grad /= world
            dense_sq += p.grad.double().pow(2).sum()
        else:
            p.grad /= ep_size
            dist.all_reduce(p.grad, group=expert_dp)
            p.grad /= dist.get_world_size(expert_dp)
            expert_sq += p.grad.double().pow(2).sum()
        grads.append(p.grad)
    dist.all_reduce(expert_sq, group=parallel_state.get_expert_model_parallel_group())  # each expert once
    norm = float((dense_sq + expert_sq).sqrt())
    coef = clip / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def moe_layer_timing(gpt, config, model: dict, device: torch.device, repeats: int) -> dict:
    """Forward+backward time of the first MoE layer on random hidden states (ms, median)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = next((m for m in gpt.modules() if isinstance(m, MoELayer)), None)
    if layer is None:
        return {}
    x = torch.randn(model["seq_length"], model["micro_batch_size"], config.hidden_size, device=device,
                    dtype=config.params_dtype, requires_grad=True)
    dy = torch.randn_like(x)
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out, _ = layer(x)
        out.backward(dy)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= 2:  # warm-up
            times.append(elapsed)
    times.sort()
    return {"moe_layer_fwd_bwd_ms_median": times[len(times) // 2], "moe_layer_fwd_bwd_ms_min": times[0],
            "moe_layer_tokens": model["seq_length"] * model["micro_batch_size"], "repeats": repeats,
            "experts_class": type(layer.experts).__name__}


def resolved_backends(gpt, device: torch.device, dtype) -> list:
    """The te_fused_moe backend each fused expert block will run (``auto`` resolved), or '-'."""
    from te_fused_moe.backends import select_backend

    names = set()
    for module in gpt.modules():
        experts = getattr(module, "experts", None)
        if experts is None or not hasattr(experts, "backend"):
            continue
        chosen = select_backend(experts.backend, device, experts.activation, experts.recipe, dtype)
        names.add(f"{experts.backend}->{chosen.name}" if experts.backend == "auto" else chosen.name)
    return sorted(names) or ["-"]


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("megatron-core", "triton", "te-fused-moe"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def steady_state_start(cuda_graph: str, config) -> int:
    """Steps left out of the steady-state tokens/s: 2 warm-up steps, plus the eager and capture
    steps of the chosen CUDA-graph mode."""
    if cuda_graph == "full_iteration":
        return 2 + FULL_ITERATION_WARMUP_STEPS
    if cuda_graph == "local":
        return 2 + int(getattr(config, "cuda_graph_warmup_steps", 3))
    return 2


def train(args) -> dict:
    from megatron_patches.cpu_compat import cpu_cuda_shim
    from megatron_patches.cuda_graph import (
        FullIterationGraph,
        create_megatron_layer_graphs,
        cuda_graph_config_fields,
        uses_megatron_layer_graphs,
    )

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda_graph = getattr(args, "cuda_graph", "none")
    graph_fields = cuda_graph_config_fields(cuda_graph, device)  # raises before any work without CUDA
    with open(args.config) as f:
        spec = yaml.safe_load(f)
    model = spec["model"]
    train_cfg = spec.get("train", {})
    impl = args.moe_grouped_gemm_impl or train_cfg.get("moe_grouped_gemm_impl", "fused")
    iters = args.train_iters or train_cfg.get("train_iters", 10)
    name = os.path.splitext(os.path.basename(args.config))[0]
    out_dir = args.out or os.path.join(ROOT, "runs", f"{name}_{impl}")
    os.makedirs(out_dir, exist_ok=True)

    torch.manual_seed(args.seed)
    with cpu_cuda_shim():  # no-op on GPU; on CPU stands in for Megatron's stream calls
        init_distributed(device, args.expert_model_parallel_size)
        if device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            # Graphs need Megatron's graph-safe RNG tracker (torch.Generator states a capture can
            # register); megatron's local CudaGraphManager refuses the default one.
            model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=cuda_graph != "none")
        config = build_config(model, impl, device,
                              {**graph_fields, **capacity_fields(getattr(args, "moe_expert_capacity_factor", None))})
        gpt = build_model(config, model, device)
        if getattr(args, "global_init", False):
            global_init(gpt, config, args.seed)
        experts = sorted({type(m.experts).__name__ for m in gpt.modules() if hasattr(m, "experts")})
        backend = resolved_backends(gpt, device, config.params_dtype)
        trainer = Trainer(gpt, args.lr or train_cfg.get("lr", 3e-4), config, device)
        world, rank = dist.get_world_size(), dist.get_rank()
        data_ranks = world if device.type == "cuda" else 1  # CPU: the replicated harness (see the flag)
        source, get_batch = batches(model, iters, args.seed, device, rank % data_ranks, data_ranks)
        tokens_per_step = model["micro_batch_size"] * model["seq_length"] * data_ranks
        say = print if rank == 0 else (lambda *a, **k: None)
        # Explicit causal mask (True = masked): Megatron's default mask is created on "cuda".
        seq = model["seq_length"]
        causal_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)

        def forward_backward(tokens, labels, loss_mask, position_ids):
            losses = trainer.model(tokens, position_ids, causal_mask, labels=labels)
            loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
            loss.backward()
            return (loss.detach(),)

        if cuda_graph == "full_iteration":
            forward_backward = FullIterationGraph(forward_backward, warmup_steps=FULL_ITERATION_WARMUP_STEPS)
        layer_graphs = uses_megatron_layer_graphs(config)

        say(f"[pretrain_moe] {name}: impl={impl} experts={experts} backend={backend} device={device} "
            f"cuda_graph={cuda_graph} {graph_fields} ranks={world} ep={args.expert_model_parallel_size} "
            f"params={sum(p.numel() for p in gpt.parameters()) / 1e6:.2f}M data={source.split(' (')[0]}",
            flush=True)
        steps = []
        for step in range(iters):
            tokens, labels, loss_mask, position_ids = get_batch(step)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.zero_grad()
            (loss,) = forward_backward(tokens, labels, loss_mask, position_ids)
            if layer_graphs:
                create_megatron_layer_graphs()  # as Megatron's schedules do after each step
            update_ok, grad_norm = trainer.step()
            if data_ranks > 1:  # log the mean loss of the data-parallel ranks (the log syncs anyway)
                dist.all_reduce(loss)
                loss = loss / data_ranks
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            record = {"step": step + 1, "loss": float(loss.detach()), "step_time_s": dt,
                      "tokens_per_s": tokens_per_step / dt,
                      "grad_norm": grad_norm, "update_ok": update_ok}
            steps.append(record)
            say(f"[pretrain_moe] step {step + 1:4d}/{iters} loss {record['loss']:.4f} "
                f"tokens/s {record['tokens_per_s']:.0f} step {dt * 1e3:.1f} ms", flush=True)
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"loss is {record['loss']} at step {step + 1}")

        repeats = args.moe_timing_iters or (20 if device.type == "cuda" else 3)
        moe_timing = moe_layer_timing(gpt, config, model, device, repeats)

    steady_from = min(steady_state_start(cuda_graph, config), len(steps) - 1)
    steady = steps[steady_from:]
    log = {
        "config_file": os.path.relpath(os.path.abspath(args.config), ROOT), "model": model, "train": train_cfg,
        "moe_grouped_gemm_impl": impl, "experts_class": experts, "fused_backend": backend, "device": str(device),
        "seed": args.seed, "iters": iters, "data": source, "optimizer": trainer.description, "versions": versions(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": steps,
        # all tokens of the steps after warm-up (and graph capture) over their total time (not a
        # mean of per-step rates, which fast steps would inflate)
        "tokens_per_s_after_warmup": tokens_per_step * len(steady) / sum(s["step_time_s"] for s in steady),
        "steady_state_from_step": steady_from + 1,
        "cuda_graph": cuda_graph, "cuda_graph_config": {k: str(v) for k, v in graph_fields.items()},
        "moe_expert_capacity_factor": getattr(args, "moe_expert_capacity_factor", None),
        "full_iteration_graph_captured": bool(getattr(forward_backward, "captured", False)),
        "moe_layer_timing": moe_timing,
        "world_size": world, "expert_model_parallel_size": args.expert_model_parallel_size,
        "data_parallel": "replicated on every rank (CPU expert-parallel harness)" if world > 1 and data_ranks == 1
        else f"{data_ranks} data-parallel rank(s)",
    }
    if rank != 0:  # one log per run
        return log
    with open(os.path.join(out_dir, "log.json"), "w") as f:
        json.dump(log, f, indent=1)
    if args.plot:
        write_plot(log, os.path.join(out_dir, "loss.png"))
    print(f"[pretrain_moe] wrote {os.path.join(out_dir, 'log.json')}; tokens/s after warm-up "
          f"{log['tokens_per_s_after_warmup']:.0f}; MoE layer fwd+bwd {moe_timing}", flush=True)
    return log


def write_plot(log: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [s["step"] for s in log["steps"]]
    ax1.plot(steps, [s["loss"] for s in log["steps"]])
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax2.plot(steps, [s["tokens_per_s"] for s in log["steps"]])
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    fig.suptitle(f"{log['config_file']} impl={log['moe_grouped_gemm_impl']} on {log['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.cuda_graph == "full_iteration" and args.device != "cpu" and torch.cuda.is_available():
        from megatron_patches.cuda_graph import side_stream

        with side_stream():  # model, DDP and every step on the stream the graph captures on
            train(args)
    else:
        train(args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
