"""``hyscale-train``: train a GPT with DSA layers (stock or HyScale) using Megatron's own flags.

Usage (any Megatron ``pretrain_gpt.py`` flags, plus HyScale's; docs/training.md has the details)::

    hyscale-train @configs/tiny_cpu.args --hyscale                      # CPU, core loop
    torchrun --nproc-per-node 8 -m hyscale_megatron.tools.train \\
        @configs/deepseek_v32_multigpu.args --tensor-model-parallel-size 2 \\
        --spec hyscale_megatron.specs hyscale_block_spec --hyscale       # GPUs, Megatron pretrain
    hyscale-train --help-hyscale                                        # HyScale's flags only

``@FILE`` arguments are replaced by the flags in FILE (shell-like quoting, ``#`` comments). The flags
are Megatron's parser (``parse_and_validate_args``) with ``add_hyscale_args`` and this module's
``--hyscale-core-loop`` / ``--hyscale-metrics-file`` / ``--hyscale-run-name``; a bad command gets one
line and exit code 2 before anything is built. Without ``--spec`` a DSA model gets
``hyscale_megatron.specs hyscale_block_spec`` (``--hyscale``, the default) or ``stock_block_spec``
(``--no-hyscale``); the HyScale settings reach ``runtime.set_config`` before any model is built.

Two back-ends, same flags, same model builder, datasets, batch and loss functions:

(a) Megatron's ``pretrain`` (the default with CUDA): what ``pretrain_gpt.py`` does for a GPT, with
    Megatron's ``GPTModelBuilder``, optimizer, any TP / PP / VPP / CP / DP layout, checkpointing.
(b) the core loop (the default without CUDA, or ``--hyscale-core-loop``): megatron.core's pipeline
    schedules, Megatron's data sampler and a plain ``torch.optim.AdamW``; gloo or NCCL, world size 1
    or more under torchrun; no checkpointing or evaluation; tied embeddings need PP=1.

Every iteration is logged in Megatron's format (loss, indexer loss, step time, tokens/s, peak
memory, replay store); ``--hyscale-metrics-file PATH`` also appends it as one JSON object per line,
which ``hyscale-compare`` reads. Unless ``TORCH_EXTENSIONS_DIR`` is set, C++ extensions Megatron
compiles on first use are cached in the virtual environment (``<venv>/torch_extensions``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import runtime
from .._log import logger
from ..arguments import add_hyscale_args, hyscale_config_from_args
from ..config import HyScaleConfigError
from .common import (HYSCALE_SPEC, SPEC_MODULE, STOCK_SPEC, OneLineParser, UsageError, expand_arg_files,
                     tool_main, topk_note)

PROG = "hyscale-train"
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


# ----------------------------------------------------------------------------- arguments
def add_train_args(parser):
    """``extra_args_provider``: HyScale's flags plus the ones of this entry point."""
    add_hyscale_args(parser)
    group = parser.add_argument_group("hyscale-train", "hyscale-train entry point")
    group.add_argument("--hyscale-core-loop", action="store_true", default=False,
                       help="Train with the megatron.core schedule loop instead of Megatron's pretrain "
                            "(the default when CUDA is unavailable).")
    group.add_argument("--hyscale-metrics-file", type=str, default=None,
                       help="Append one JSON object per iteration (loss, step time, memory) to this file.")
    group.add_argument("--hyscale-run-name", type=str, default=None,
                       help="Label of this run in the log and the metrics file (default: stock/hyscale).")
    group.add_argument("--help-hyscale", action="store_true", default=False,
                       help="Print only the HyScale and hyscale-train flags and exit.")
    return parser


# a %-format conversion of argparse's help expansion; any other '%' is a literal percent sign
_HELP_FORMAT = re.compile(r"%%|%\([^)]*\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|%")


def _escape_help(text: Optional[str]) -> Optional[str]:
    """Escape literal '%' signs (e.g. megatron-core's "1.10 = 10%)") so that argparse can expand the help."""
    if not text:
        return text
    return _HELP_FORMAT.sub(lambda m: "%%" if m.group(0) == "%" else m.group(0), text)


def build_parser(hyscale_only: bool = False, parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    """hyscale-train's parser, HyScale's groups first; with ``hyscale_only`` without Megatron's flags."""
    p = parser_class(prog=PROG, allow_abbrev=False, usage=f"{PROG} [@FILE ...] [FLAGS ...]", description=(
        "Train a GPT with DSA layers, stock or HyScale, with Megatron's flags (@FILE reads flags from FILE). "
        + ("This lists HyScale's flags; hyscale-train --help lists Megatron's too." if hyscale_only else
           "HyScale's flags come first; hyscale-train --help-hyscale lists only them.")))
    add_train_args(p)
    if not hyscale_only:
        from megatron.training.arguments import add_megatron_arguments  # noqa: PLC0415

        add_megatron_arguments(p)
    for action in p._actions:
        action.help = _escape_help(action.help)
    return p


_CHECK_PARSER: Optional[argparse.ArgumentParser] = None


def check_flags(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` (``@FILE`` expanded) with Megatron's parser and HyScale's flags, without Megatron's
    validation (that depends on the launcher's world size), and check the HyScale settings.
    Raises :class:`UsageError` with one line."""
    global _CHECK_PARSER
    if _CHECK_PARSER is None:
        _CHECK_PARSER = build_parser(parser_class=OneLineParser)
    args = _CHECK_PARSER.parse_args(expand_arg_files(argv))
    try:
        hyscale_config_from_args(args)
    except HyScaleConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.train_iters is None and getattr(args, "train_samples", None) is None:
        raise UsageError("give the number of iterations: --train-iters N")
    if args.train_iters is not None and args.train_iters < 1:
        raise UsageError(f"--train-iters must be >= 1, got {args.train_iters}")
    return args


@contextlib.contextmanager
def _argv(argv: Sequence[str]):
    saved = sys.argv
    sys.argv = [saved[0] if saved else PROG, *argv]
    try:
        yield
    finally:
        sys.argv = saved


def parse_train_args(argv: Sequence[str], fresh: bool = True):
    """Megatron's ``parse_and_validate_args`` with our flags; sets Megatron's global args.

    ``fresh`` unsets Megatron's global variables first, so that a process may train twice.
    Also fills in a DSA ``--spec`` from ``--hyscale/--no-hyscale`` when none was given, and the
    mock-data default.
    """
    from megatron.training import global_vars  # noqa: PLC0415
    from megatron.training.arguments import parse_and_validate_args  # noqa: PLC0415

    from hyscale_patches import training_compat  # noqa: PLC0415

    training_compat.apply()
    argv = expand_arg_files(argv)
    if fresh:
        global_vars.unset_global_variables()
    with _argv(argv):
        args = parse_and_validate_args(extra_args_provider=add_train_args, args_defaults={})
    _finish_args(args)
    return args


def _finish_args(args) -> None:
    if args.data_path is None and getattr(args, "train_data_path", None) is None and not args.mock_data:
        args.mock_data = True
    if getattr(args, "eval_interval", None) is None and getattr(args, "train_iters", None):
        # megatron-core 0.19.2's pretrain divides by eval_interval (default None): evaluate once, at the end.
        args.eval_interval = args.train_iters
    hs = hyscale_config_from_args(args)
    if getattr(args, "experimental_attention_variant", None) == "dsa":
        if args.spec is None:
            args.spec = [SPEC_MODULE, HYSCALE_SPEC if hs.enabled else STOCK_SPEC]
    args.hyscale_uses_hyscale_spec = bool(args.spec and list(args.spec) == [SPEC_MODULE, HYSCALE_SPEC]
                                          and hs.enabled)
    if args.hyscale_run_name is None:
        args.hyscale_run_name = "hyscale" if args.hyscale_uses_hyscale_spec else "stock"


def install_hyscale_config(args):
    """``runtime.set_config(hyscale_config_from_args(args))`` -- before any model is built."""
    cfg = hyscale_config_from_args(args)
    runtime.set_config(cfg)
    return cfg


def _unwrap_config(cfg):
    """GPTModelBuilder passes its ``GPTModelConfig`` to spec callables; ours want the TransformerConfig."""
    return getattr(cfg, "transformer", cfg)


def _adapt_spec(fn):
    if fn is None or not callable(fn) or getattr(fn, "_hyscale_adapted", False):
        return fn
    import inspect  # noqa: PLC0415

    try:
        takes_vp = "vp_stage" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_vp = False

    def spec(config, vp_stage=None):
        cfg = _unwrap_config(config)
        return fn(cfg, vp_stage=vp_stage) if takes_vp else fn(cfg)

    spec._hyscale_adapted = True
    spec.__name__ = getattr(fn, "__name__", "spec")
    spec.__wrapped__ = fn
    return spec


def gpt_model_config(args):
    """The ``GPTModelConfig`` Megatron's ``GPTModelBuilder`` builds from (spec callable adapted)."""
    from megatron.training.argument_utils import gpt_config_from_args  # noqa: PLC0415

    model_cfg = gpt_config_from_args(args)
    spec = model_cfg.transformer_layer_spec
    if spec is not None and not hasattr(spec, "submodules") and callable(spec):
        model_cfg.transformer_layer_spec = _adapt_spec(spec)
    return model_cfg


# ----------------------------------------------------------------------------- model
def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron ``model_provider``: one GPT stage built by ``GPTModelBuilder`` with the --spec."""
    from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: PLC0415
    from megatron.training import get_args  # noqa: PLC0415

    args = get_args()
    install_hyscale_config(args)
    model_cfg = gpt_model_config(args)
    if config is not None:
        model_cfg.transformer = config
    builder = model_cfg.get_builder_cls()(model_cfg)
    pg = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
    return builder.build_model(pg, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def core_attention_kinds(models) -> dict:
    """{'DSAttention': n, 'HyScaleDSAttention': m, ...}: which DSA cores the built model uses."""
    counts: dict[str, int] = {}
    for m in models if isinstance(models, (list, tuple)) else [models]:
        for mod in m.modules():
            name = type(mod).__name__
            if name in ("DSAttention", "HyScaleDSAttention"):
                counts[name] = counts.get(name, 0) + 1
    return counts


# ----------------------------------------------------------------------------- data
def gpt_dataset_config(args):
    """``GPTDatasetConfig`` from the flags (the pretraining subset of pretrain_gpt.py's)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: PLC0415
    from megatron.training import get_tokenizer  # noqa: PLC0415
    from megatron.training.utils import get_blend_and_blend_per_split  # noqa: PLC0415

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
    )


def is_dataset_built_on_rank(vp_stage=None):
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: PLC0415

    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock (``MockGPTDataset``) or indexed (``GPTDataset``) data via ``BlendedMegatronDatasetBuilder``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: PLC0415
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset  # noqa: PLC0415
    from megatron.training import get_args, print_rank_0  # noqa: PLC0415

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        gpt_dataset_config(args),
    ).build()


train_valid_test_datasets_provider.is_distributed = True


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_batch(data_iterator, vp_stage=None):
    """One microbatch on this rank: TP-broadcast from TP rank 0, then sliced for CP."""
    from megatron.core import parallel_state as mpu  # noqa: PLC0415
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: PLC0415
    from megatron.training import get_args  # noqa: PLC0415
    from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: PLC0415

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        dev = _device()
        for key in BATCH_KEYS:
            val = raw.get(key)
            batch[key] = val.to(dev, non_blocking=True) if isinstance(val, torch.Tensor) else None
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = {k: batch.get(k) for k in BATCH_KEYS}
    batch["cu_seqlens"] = None
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(k) for k in BATCH_KEYS)


def loss_func(loss_mask, output_tensor, model=None):
    """Sum of masked per-token losses, token count, and Megatron's ``{'lm loss': [sum, n]}`` report."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite LM loss in the forward pass: {loss.item()}")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).to(loss)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron ``forward_step_func`` for GPT."""
    from megatron.core.utils import get_attr_wrapped_model  # noqa: PLC0415

    vp_stage = get_attr_wrapped_model(model, "vp_stage", allow_none=True)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


# ----------------------------------------------------------------------------- metrics
def replay_store_bytes() -> Optional[int]:
    """Bytes held by HyScale's selection-replay store, when that module exists."""
    try:
        from .. import replay  # noqa: PLC0415
    except ImportError:
        return None
    fn = getattr(replay, "store_stats", None)
    if fn is None:
        return None
    try:
        stats = fn()
    except Exception:  # noqa: BLE001 - metrics must never break training
        return None
    if isinstance(stats, dict):
        # per-iteration peak: read it, then restart the peak at the current size
        reset = getattr(getattr(replay, "get_store", lambda: None)(), "reset_peak", None)
        for key in ("peak_bytes", "current_bytes", "bytes"):
            if key in stats:
                if reset is not None:
                    reset()
                return int(stats[key])
        return None
    return int(stats) if isinstance(stats, (int, float)) else None


def _check_replay_store_empty(iteration: int) -> None:
    """Every replay entry is consumed by its recompute within the step; leftovers mean a forward
    ran without its backward. Clear them (logged once) so no stale indices survive the step."""
    from .. import replay  # noqa: PLC0415

    store = replay.get_store()
    if len(store):
        logger.warning(
            "iteration %d: replay store still holds %d entries (%s) after the step; clearing",
            iteration, len(store), store.keys()[:4])
        store.clear(warn=False)


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def format_log_line(rec: dict, train_iters: int) -> str:
    """Megatron's per-iteration log format (training_log) with our fields."""
    parts = [
        f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {rec['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {rec['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {rec['step_ms']:.1f}",
        f"tokens/s: {rec['tokens_per_s']:.0f}",
        f"learning rate: {rec['lr']:.6E}",
        f"global batch size: {rec['global_batch_size']:5d}",
        f"lm loss: {rec['lm_loss']:.6E}",
    ]
    if rec.get("indexer_loss") is not None:
        parts.append(f"indexer loss: {rec['indexer_loss']:.6E}")
    parts.append(f"peak memory (MB): {rec['peak_mem_bytes'] / 2**20:.1f}")
    if rec.get("replay_store_bytes"):
        parts.append(f"replay store peak (MB): {rec['replay_store_bytes'] / 2**20:.2f}")
    return " | ".join(parts) + " |"


class MetricsWriter:
    def __init__(self, path: Optional[str], run: str):
        self.path, self.run = path, run
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def write(self, rec: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"run": self.run, **rec}) + "\n")


def _indexer_loss_and_clean(num_microbatches: int) -> Optional[float]:
    """Mean over layers of the DSA indexer loss this step (Megatron's reduction), then clear."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (  # noqa: PLC0415
        DSAIndexerLossLoggingHelper as H,
    )

    if "values" not in H.tracker:
        return None
    H.reduce_loss_in_tracker()
    vals = H.tracker["values"] / num_microbatches
    out = float(vals.sum() / vals.numel())
    H.clean_loss_in_tracker()
    return out


# ----------------------------------------------------------------------------- back-end (b)
def _init_distributed(args) -> None:
    from megatron.core import parallel_state  # noqa: PLC0415

    from hyscale_patches import cpu_compat, training_compat  # noqa: PLC0415

    cpu_compat.apply()
    training_compat.apply()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from ..env import free_port  # noqa: PLC0415

            os.environ["MASTER_PORT"] = str(free_port())
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", args.rank % torch.cuda.device_count())))
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=args.rank, world_size=args.world_size)
    elif torch.distributed.get_world_size() != args.world_size:
        raise UsageError(f"process group has world size {torch.distributed.get_world_size()}, "
                               f"the flags say {args.world_size} (WORLD_SIZE)")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )


def _seed(args) -> None:
    from megatron.core import parallel_state  # noqa: PLC0415

    from ..env import seed_all  # noqa: PLC0415

    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

        seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    else:
        seed_all(args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())


def _check_core_loop_args(args) -> None:
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        raise UsageError("the core loop does not sync tied embedding gradients across pipeline stages: "
                               "add --untie-embeddings-and-output-weights, or use Megatron's pretrain (GPU)")
    for flag in ("load", "save"):
        if getattr(args, flag, None):
            logger.warning("hyscale-train core loop: --%s is ignored (no checkpointing in the core loop)", flag)


def build_models(args) -> list:
    from megatron.core.enums import ModelType  # noqa: PLC0415
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage  # noqa: PLC0415
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage  # noqa: PLC0415
    from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: PLC0415

    pg = ProcessGroupCollection.use_mpu_process_groups()
    vp = args.virtual_pipeline_model_parallel_size
    stages = list(range(vp)) if vp else [None]
    models = []
    for st in stages:
        pre = is_pp_first_stage(pg.pp) and (st is None or is_vp_first_stage(vp_stage=st, vp_size=vp))
        post = is_pp_last_stage(pg.pp) and (st is None or is_vp_last_stage(vp_stage=st, vp_size=vp))
        m = model_provider(pre_process=pre, post_process=post, vp_stage=st, pg_collection=pg)
        m.model_type = ModelType.encoder_or_decoder
        if st is not None:
            m.vp_stage = st
        if args.bf16:
            m = m.to(torch.bfloat16)
        elif args.fp16:
            m = m.to(torch.float16)
        models.append(m.to(_device()))
    return models


def _lr_at(args, it: int) -> float:
    """LR for iteration ``it`` (1-based): linear warmup, then constant / linear / cosine decay."""
    warm = args.lr_warmup_iters or 0
    if warm and it <= warm:
        return args.lr * it / warm
    style = args.lr_decay_style
    total = (args.lr_decay_iters or args.train_iters) - warm
    frac = min(max((it - warm) / max(total, 1), 0.0), 1.0)
    min_lr = args.min_lr or 0.0
    if style == "linear":
        return min_lr + (args.lr - min_lr) * (1 - frac)
    if style == "cosine":
        return min_lr + (args.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    return args.lr


def _data_iterators(args, models):
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader  # noqa: PLC0415

    n_train = args.train_iters * args.global_batch_size
    vp = args.virtual_pipeline_model_parallel_size
    stages = list(range(vp)) if vp else [None]
    iters = []
    for st in stages:
        if is_dataset_built_on_rank(st):
            train_ds, _, _ = train_valid_test_datasets_provider([n_train, 0, 0], vp_stage=st)
            loader = build_pretraining_data_loader(train_ds, 0)
            iters.append(iter(loader))
        else:
            iters.append(None)
    return iters if vp else iters[0]


def run_core_loop(args) -> list[dict]:
    """Back-end (b): megatron.core schedules + torch AdamW. Returns the per-iteration records."""
    from megatron.core import parallel_state as mpu  # noqa: PLC0415
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.core.utils import get_model_config  # noqa: PLC0415

    _check_core_loop_args(args)
    _init_distributed(args)
    _seed(args)
    hs = install_hyscale_config(args)
    models = build_models(args)
    kinds = core_attention_kinds(models)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    log_rank = world - 1
    if rank == log_rank:
        print(f"> hyscale-train core loop | run {args.hyscale_run_name} | spec {' '.join(args.spec or [])} | "
              f"DSA cores {kinds} | hyscale {hs} | TP={args.tensor_model_parallel_size} "
              f"PP={args.pipeline_model_parallel_size} CP={args.context_parallel_size} DP={args.data_parallel_size} | "
              f"device {_device()}", flush=True)
    config = get_model_config(models[0])
    config.grad_scale_func = None
    if not torch.cuda.is_available():
        config.batch_p2p_sync = False  # its torch.cuda.synchronize() guards CUDA streams only
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                              weight_decay=args.weight_decay)
    data_iter = _data_iterators(args, models)
    fwd_bwd = get_forward_backward_func()
    dp_group = mpu.get_data_parallel_group(with_context_parallel=True)
    dp_size = torch.distributed.get_world_size(dp_group)
    writer = MetricsWriter(args.hyscale_metrics_file if rank == log_rank else None, args.hyscale_run_name)
    tokens_per_iter = args.global_batch_size * args.seq_length
    records = []
    for it in range(1, args.train_iters + 1):
        lr = _lr_at(args, it)
        for g in optim.param_groups:
            g["lr"] = lr
        for m in models:
            m.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n_mb = get_num_microbatches()
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=data_iter,
                         model=models if len(models) > 1 else models[0], num_microbatches=n_mb,
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         decoder_seq_length=args.seq_length, forward_only=False)
        if dp_size > 1:
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp_size)
        if args.clip_grad and args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        optim.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        _check_replay_store_empty(it)
        # LM loss: sum and token count over every microbatch on every rank (only last stages add).
        stats = torch.zeros(2, dtype=torch.float64, device=_device())
        for rep in losses or []:
            stats += rep["lm loss"].to(stats)
        torch.distributed.all_reduce(stats)
        lm_loss = float(stats[0] / stats[1].clamp_min(1))
        idx_loss = _indexer_loss_and_clean(n_mb)
        rec = dict(iteration=it, lm_loss=lm_loss, indexer_loss=idx_loss, step_ms=step_s * 1e3,
                   tokens_per_s=tokens_per_iter / step_s, peak_mem_bytes=peak_memory_bytes(),
                   replay_store_bytes=replay_store_bytes(), lr=lr, consumed_samples=it * args.global_batch_size,
                   global_batch_size=args.global_batch_size, seq_length=args.seq_length, backend="core-loop")
        records.append(rec)
        if rank == log_rank:
            if it % max(args.log_interval, 1) == 0 or it in (1, args.train_iters):
                print(format_log_line(rec, args.train_iters), flush=True)
            writer.write(rec)
        if not math.isfinite(lm_loss):
            raise FloatingPointError(f"iteration {it}: LM loss is {lm_loss}")
    return records


# ----------------------------------------------------------------------------- back-end (a)
def _metrics_train_step(original, args):
    """Wrap Megatron's ``train_step``: time it and record loss/memory for ``--hyscale-metrics-file``."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415

    state = {"it": 0}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    writer = MetricsWriter(args.hyscale_metrics_file if rank == world - 1 else None, args.hyscale_run_name)

    def train_step(*a, **kw):
        from megatron.core.transformer.experimental_attention_variant.dsa import (  # noqa: PLC0415
            DSAIndexerLossLoggingHelper as H,
        )

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original(*a, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        state["it"] += 1
        _check_replay_store_empty(state["it"])
        loss_dict = out[0] if isinstance(out, tuple) and out else {}
        lm = loss_dict.get("lm loss") if isinstance(loss_dict, dict) else None
        if isinstance(lm, torch.Tensor):
            lm = float(lm[0] / lm[1]) if lm.numel() == 2 else float(lm)
        vals = H.tracker.get("values")
        idx = None if vals is None else float(vals.sum() / vals.numel() / get_num_microbatches())
        rec = dict(iteration=args.iteration + state["it"] if hasattr(args, "iteration") else state["it"],
                   lm_loss=lm, indexer_loss=idx, step_ms=step_s * 1e3,
                   tokens_per_s=args.global_batch_size * args.seq_length / step_s,
                   peak_mem_bytes=peak_memory_bytes(), replay_store_bytes=replay_store_bytes(),
                   global_batch_size=args.global_batch_size, seq_length=args.seq_length, backend="pretrain")
        writer.write(rec)
        it = rec["iteration"]
        if rank == world - 1 and rec["replay_store_bytes"] and it % max(getattr(args, "log_interval", 1) or 1, 1) == 0:
            # next to Megatron's own per-iteration line (printed by training_log on the last rank)
            print(f" [hyscale] iteration {it:8d} | replay store peak (MB): {rec['replay_store_bytes'] / 2**20:.2f} |",
                  flush=True)
        return out

    train_step.__wrapped__ = original
    return train_step


def _single_process_rendezvous() -> None:
    """Outside torchrun (one GPU, ``python -m hyscale_megatron.tools.train``), Megatron's env://
    rendezvous still needs MASTER_ADDR/PORT, RANK, WORLD_SIZE and LOCAL_RANK: default them."""
    if "WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or not torch.cuda.is_available():
        return
    from ..env import free_port  # noqa: PLC0415

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def run_pretrain(args) -> None:
    """Back-end (a): Megatron's ``pretrain`` for GPT with our spec and overlays."""
    from megatron.core.enums import ModelType  # noqa: PLC0415
    from megatron.training import pretrain, training  # noqa: PLC0415
    from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: PLC0415

    from hyscale_patches import training_compat  # noqa: PLC0415

    training_compat.apply()
    _single_process_rendezvous()
    install_hyscale_config(args)
    model_cfg = gpt_model_config(args)
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    saved = training.train_step
    # always wrapped: it also checks that the replay store is empty after every step
    training.train_step = _metrics_train_step(saved, args)
    try:
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    finally:
        training.train_step = saved


# ----------------------------------------------------------------------------- entry point
def choose_backend(args) -> str:
    return "core-loop" if (args.hyscale_core_loop or not torch.cuda.is_available()) else "pretrain"


def venv_extensions_dir() -> Optional[Path]:
    """``<venv>/torch_extensions`` when this Python runs in a writable virtual environment, else None."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return Path(sys.prefix) / "torch_extensions"


def use_venv_extensions_dir() -> None:
    """Unless ``TORCH_EXTENSIONS_DIR`` is set, build and cache torch C++ extensions in the venv: built
    once per environment, by its own torch, with no lock shared with other environments."""
    path = venv_extensions_dir()
    if "TORCH_EXTENSIONS_DIR" not in os.environ and path is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(path)


def _parse_or_usage_error(argv: Sequence[str]):
    """``parse_train_args``, with Megatron's validation failures turned into one line."""
    import traceback  # noqa: PLC0415

    try:
        return parse_train_args(argv)
    except UsageError:
        raise
    except (AssertionError, ValueError) as exc:
        msg = str(exc) or f"assertion failed: {traceback.extract_tb(exc.__traceback__)[-1].line}"
        raise UsageError(f"Megatron's argument validation refuses the flags: {msg}") from None


def _main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    if "--help-hyscale" in argv:
        build_parser(hyscale_only=True).print_help()
        return 0
    check_flags(argv)
    use_venv_extensions_dir()
    args = _parse_or_usage_error(argv)
    note = topk_note(getattr(args, "dsa_indexer_topk", None), args.seq_length)
    if note and args.rank == 0:
        print(f"{PROG}: note: {note}", flush=True)
    if choose_backend(args) == "core-loop":
        run_core_loop(args)
    else:
        run_pretrain(args)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return tool_main(PROG, _main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
