"""docs/MEGATRON.md: every Megatron-LM (and Megatron-DeepSpeed) flag family, and for each flag
whether gigatron supports it, accepts it without effect (and why), or does not support it
(and why); generated from the config table and `training/config/megatron/catalog.py`, never hand-kept:
`python -m gigatron.training.config.megatron.doc > docs/MEGATRON.md`.

A flag's status comes from the config table: a row with the flag is "supported", unless its
doc says it is accepted without effect (the table's convention: the doc begins with
"accepted", or says ": accepted", or the row is an implementation selector, which computes
the same numbers whichever is chosen) or refused ("refused: why"). A Megatron flag without a
row is "not supported", with the first reason of `REASONS` whose prefix it starts with, else
its family's reason.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Optional, Tuple

from gigatron.training.config.table import Row, table
from gigatron.training.config.megatron.reasons import MORE_REASONS
from gigatron.training.config.megatron.catalog import (MEGATRON_DEEPSPEED, MEGATRON_DEEPSPEED_SOURCE,
                                              MEGATRON_LM, MEGATRON_LM_SOURCE, entries)

SUPPORTED, NO_EFFECT, SELECTOR, REFUSED, NOT_SUPPORTED = (
    "supported", "accepted without effect", "implementation selector", "refused",
    "not supported")

_MOE = ("this mixture-of-experts option is not implemented (docs/FLAGS.md, section "
        "\"mixture of experts\", lists the MoE flags gigatron has)")
_MOE_REASONS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("--moe-enable-deepep", "--moe-flex-dispatcher", "--moe-deepep-", "--moe-hybridep-",
      "--moe-permute-fusion-into-hybridep", "--moe-ncclep-", "--moe-dispatch-fwd-dtype",
      "--moe-combine-bwd-dtype"),
     "the flex dispatcher's DeepEP/HybridEP/NCCL-EP kernels are not used: "
     "--moe-token-dispatcher-type alltoall or allgather"),
    (("--moe-router-padding-for-",),
     "padding the routing map for Transformer Engine's FP8/FP4 grouped GEMMs is not needed: "
     "gigatron's grouped matmul takes any token counts"),
    (("--moe-enable-routing-replay", "--moe-routing-trace"),
     "routing replay and routing traces are not provided"),
    (("--moe-use-upcycling", "--moe-upcycling-"),
     "upcycling a dense checkpoint into an MoE model is not implemented"),
    (("--moe-use-grouped-tensor", "--moe-single-grouped-", "--use-grouped-gemm-for-"),
     "a fused kernel or weight layout of Transformer Engine that is not used: gigatron's "
     "router and experts compute the same numbers (--moe-grouped-gemm picks the grouped "
     "matmul)"),
    (("--overlap-moe-expert-parallel-comm", "--overlap-dispatch-backward",
      "--ep-overlap-early", "--moe-paged-stash", "--moe-pad-experts-for-cuda-graph"),
     "overlap of the expert-parallel communication, paged stashing and CUDA graphs are not "
     "implemented"),
    (("--moe-expert-parallel-size", "--enable-expert-tensor-parallelism",
      "--disable-moe-token-dropping", "--create-moe", "--use-tutel", "--topk", "--mlp-type",
      "--num-experts-switch", "--moe-train-capacity-factor", "--moe-eval-capacity-factor",
      "--moe-min-capacity", "--moe-loss-coeff", "--disable-moe-top2", "--expert-interval"),
     "mixture of experts through DeepSpeed's MoE layer (Megatron-DeepSpeed's flags) is not "
     "provided: use Megatron-Core's flags (--num-experts, --moe-router-topk, "
     "--moe-expert-capacity-factor, --moe-aux-loss-coeff, --expert-model-parallel-size)"),
    (("--moe-", "--expert-"), _MOE),
)
_FP8 = ("not provided: gigatron runs FP8 with delayed, tensorwise or blockwise scaling in the "
        "transformer layers (--fp8-format, --fp8-recipe, docs/FP8.md); FP4, mxfp8 and the "
        "other FP8 knobs need Transformer Engine")
_TE = "Transformer Engine and its communication overlap are not used"
_CLUSTER = ("NVIDIA cluster tooling is not part of gigatron (its watchdog names hung or dead "
            "ranks and ends the job: --distributed-timeout-minutes)")
_LOG = ("this series is not logged: the console line and --metrics-file carry loss, lr, grad "
        "norm, loss scale, skipped steps, throughput, MFU and memory")
_FSDP = "Megatron's FSDP is not provided: --zero-stage 3 shards parameters the same way"
# (flag prefixes, reason), first match wins
REASONS: Tuple[Tuple[Tuple[str, ...], str], ...] = _MOE_REASONS + (
    (("--fp8", "--fp4", "--first-last-layers-bf16", "--num-layers-at-", "--keep-fp8",
      "--reuse-grad-buf-for-mxfp8"), _FP8),
    (("--te-", "--use-te-", "--use-transformer-engine",
      "--use-kitchen", "--kitchen-", "--fused-residual-rmsnorm", "--symmetric-ar"), _TE),
    (("--cuda-graph", "--enable-cuda-graph", "--external-cuda-graph", "--optimizer-cuda-graph",
      "--decode-only-cuda-graphs", "--delay-offload-until-cuda-graph"),
     "CUDA graphs are not used"),
    (("--mtp-",), "multi-token prediction's standalone stage, repeated or detached heads "
     "and hybrid patterns are not implemented (--mtp-num-layers and "
     "--mtp-loss-scaling-factor are: its modules on the last pipeline stage)"),
    (("--hybrid-context", "--max-seqlen-per-dp-cp"),
     "hybrid context parallelism is not implemented: --context-parallel-size with "
     "--cp-comm-type p2p, all_gather, a2a or a2a+p2p is"),
    (("--ds-sequence-parallel", "--force-ds-sequence-parallel"),
     "DeepSpeed-Ulysses sequence parallelism is --context-parallel-size with "
     "--cp-comm-type a2a"),
    (("--mamba", "--hybrid-", "--is-hybrid", "--gdp-", "--linear-", "--spec", "--mhc-",
      "--enable-mhc", "--mlp-chunks"), "Mamba, hybrid and custom layer specs are not implemented"),
    (("--mup", "--use-mup"), "muP parametrisation is not implemented"),
    (("--muon-use-syrk",), "the Triton SYRK kernel is not used: Newton-Schulz's Gram matrix "
     "is a plain matmul (the same numbers)"),
    (("--lion",), "gigatron's --optimizer is adam (AdamW), sgd or muon: Lion is not built"),
    (("--megatron-fsdp", "--use-megatron-fsdp", "--use-torch-fsdp2", "--fsdp",
      "--torch-fsdp2", "--data-parallel-sharding-strategy", "--outer-dp-sharding",
      "--enable-full-sharding", "--num-distributed-optimizer-instances"), _FSDP),
    (("--pytorch-profiler-collect-chakra", "--record-shapes", "--nvtx"),
     "Chakra execution traces and nsys's NVTX ranges are not provided: --profile "
     "--use-pytorch-profiler writes a torch.profiler trace, --timeline every rank's spans "
     "(docs/TIMELINE.md)"),
    (("--log-", "--no-log-", "--tensorboard-log-interval", "--timing-log-option",
      "--wandb-entity", "--logging-level"), _LOG),
    (("--fim-",), "fill-in-the-middle data is not implemented"),
    (("--retro", "--retriever"), "Retro is not part of gigatron"),
    (("--kd", "--mos", "--load-teacher", "--num-layers-teacher", "--num-experts-teacher",
      "--hidden-size-teacher", "--num-attention-heads-teacher", "--reset-iteration"),
     "distillation is not part of gigatron"),
    (("--random-ltd", "--data-efficiency"), "DeepSpeed's data-efficiency library is not used"),
    (("--enable-zbh1",), "Megatron-DeepSpeed's zero-bubble switch: use --pipeline-schedule "
                         "zb-h1 (or zbv)"),
    (("--no-rope-freq", "--mrope"),
     "this RoPE variant is not implemented (--rotary-base, --rotary-percent, "
     "--use-rope-scaling and --rope-type yarn are)"),
    (("--ckpt-", "--no-ckpt-", "--async-", "--dist-ckpt", "--use-dist-ckpt",
      "--use-persistent-ckpt", "--auto-detect-ckpt", "--replication",
      "--distrib-optim", "--load-main-params", "--no-strict-fsdp", "--no-save-tokenizer"),
     "a knob of Megatron's distributed checkpointing; gigatron's torch_dist checkpoints "
     "are written through torch.distributed.checkpoint with gigatron's own tensor names "
     "and load into any layout (docs/CHECKPOINTS.md)"),
    (("--inference", "--flash-decode", "--nccl-all-reduce-for-prefill"),
     "text generation is not part of pretrain_gpt.py"),
    (("--dataloader-inter-document",),
     "not implemented: --reset-attention-mask keeps attention inside each packed document "
     "(docs/PACKED_SEQUENCES.md)"),
    (("--padded-vocab-size", "--no-pad-vocab-size"),
     "the vocabulary is always padded to --make-vocab-size-divisible-by x tp"),
    (("--chat-template", "--tokenizer-metadata", "--use-gigatoken",
      "--tokenizer-sentencepiece-", "--no-tokenizer-sentencepiece-", "--null-tokenizer-pad-id"),
     "a tokenizer option for chat/SFT data or Megatron's metadata files; not needed to "
     "pretrain (docs/DATA.md)"),
) + MORE_REASONS
FAMILY_REASONS: Dict[str, str] = {
    "vision": "vision models are not part of gigatron (GPT only)",
    "biencoder": "retrieval (ICT/biencoder) models are not part of gigatron",
    "inference": "text generation is not part of pretrain_gpt.py",
    "rl": "reinforcement learning (GRPO) is not part of gigatron",
    "Logits Distillation": "distillation is not part of gigatron",
    "moe": _MOE,
    "mla": "Flash MLA's latent cache of Megatron's dynamic inference engine and Transformer "
           "Engine's fused down-projection are not used: gigatron's multi-latent attention "
           "computes the same numbers (and `gigatron generate` caches the latents)",
    "experimental_attention_variant": "experimental attention variants are not implemented",
    "heterogeneous architecture": "heterogeneous layer configurations are not implemented",
    "experimental": "experimental Megatron-Core features are not implemented",
    "Transformer-Engine": _TE, "retro": "Retro is not part of gigatron",
    "sft": "Megatron's SFTTokenizer prompt formats are not used: --sft tokenizes with the "
           "HuggingFaceTokenizer's own chat template (docs/SFT.md)",
    "In-process restart": _CLUSTER, "ft_package": _CLUSTER,
    "workload inspector": _CLUSTER, "opentelemetry": _CLUSTER, "one logger": _CLUSTER,
    "autoresume": _CLUSTER, "msc": _CLUSTER, "fault injector": _CLUSTER,
    "rerun engine": _CLUSTER, "distillation": "distillation is not part of gigatron",
    "memory optimizations": "DeepSpeed's tiled/scattered memory optimisations are not used",
    "ZeRO": "a DeepSpeed ZeRO knob gigatron's ZeRO does not have (docs/FLAGS.md lists the "
            "ZeRO flags and JSON keys it reads)",
    "activation checkpointing": "DeepSpeed's activation-checkpointing options are not used: "
                                "--recompute-granularity/--recompute-method choose what is "
                                "recomputed",
}
GENERIC_REASON = "not implemented in gigatron"
# flags whose default differs from Megatron's on purpose (flag -> why)
DIFFERENT_DEFAULTS: Dict[str, str] = {
    "--cp-comm-type": "Megatron-Core takes a list (one comm type per layer); gigatron takes "
                      "one for every layer: the same p2p default",
}


@functools.lru_cache(maxsize=None)
def _rows_by_flag() -> Dict[str, Row]:
    rows: Dict[str, Row] = {}
    for row in table():
        for flag in row.spec.flags + ((row.spec.negative,) if row.spec.negative else ()):
            rows[flag] = row
    return rows


def row_status(row: Row) -> str:
    """supported / accepted without effect / implementation selector / refused, by the
    table's conventions (see the module doc)."""
    doc = row.spec.doc.lower()
    if doc.startswith("refused"):
        return REFUSED
    if doc.startswith("accepted") or ": accepted" in doc:
        return NO_EFFECT
    if row.owner.__name__ == "ImplementationSettings":
        return SELECTOR
    return SUPPORTED


def unsupported_reason(flag: str, family: str) -> str:
    """Why gigatron has no such flag."""
    for prefixes, reason in REASONS:
        if flag.startswith(prefixes):
            return reason
    return FAMILY_REASONS.get(family, GENERIC_REASON)


def status(names: Tuple[str, ...], family: str) -> Tuple[str, Optional[Row], str]:
    """(status, the row or None, its note) of a Megatron flag and its aliases."""
    rows = _rows_by_flag()
    row = next((rows[n] for n in names if n in rows), None)
    if row is None:
        return NOT_SUPPORTED, None, unsupported_reason(names[0], family)
    return row_status(row), row, row.spec.doc


def megatron_flag_note(flag: str) -> Optional[str]:
    """'--x is a Megatron flag gigatron does not support: why', for an unknown-flag message;
    None when `flag` is not a Megatron or Megatron-DeepSpeed flag."""
    for project, source in (("Megatron", MEGATRON_LM), ("Megatron-DeepSpeed", MEGATRON_DEEPSPEED)):
        for family, names, _ in entries(source):
            if flag in names:
                state, _, note = status(names, family)
                if state == NOT_SUPPORTED:
                    return f"{flag} is a {project} flag gigatron does not support: {note}"
    return None


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")


def default_differences() -> List[Tuple[str, Any, Any]]:
    """(flag, Megatron's default, gigatron's) where both are set and differ."""
    rows, out = _rows_by_flag(), []
    for _, names, default in entries(MEGATRON_LM):
        row = next((rows[n] for n in names if n in rows), None)
        if row is None or default is None or row.default is None or row.type is bool:
            continue
        if row.default != default:
            out.append((names[0], default, row.default))
    return out


# where gigatron's numbers differ from Megatron-Core's for the same flags, and why
NOTES = (
    "Padded vocabulary columns (the vocabulary rounded up to --make-vocab-size-divisible-by x "
    "tp, default 128, as in Megatron): Megatron-Core's loss takes the softmax over every "
    "column, padding included (randomly initialised rows); gigatron masks the padding out of "
    "the loss (no probability, no gradient) and starts those rows at zero, so the numbers do "
    "not depend on tp, which changes the padding. At initialisation Megatron's loss is higher "
    "by about log(padded / vocab): 0.0009 for GPT-2's 50257 -> 50304 at tp 1, 0.019 at tp 8; "
    "training pushes the padding logits down and the difference fades.",
    "The order of samples is not Megatron's (same construction, but a shuffle per epoch "
    "instead of its separate last epoch, so a run can be extended); see docs/DATA.md.",
    "Tokenizers follow Megatron-Core's tokenizer library; legacy Megatron and "
    "Megatron-DeepSpeed differ for SentencePieceTokenizer (added <CLS>/<SEP>/<EOD>/<MASK>) and "
    "Llama2Tokenizer (BOS per document); see docs/DATA.md.",
)


Flags = List[Tuple[Tuple[str, ...], Any]]  # (flag and aliases, Megatron's default) per flag


def _family_section(title: str, family: str, flags: Flags) -> List[str]:
    known: List[str] = []
    missing: Dict[str, List[str]] = {}
    for names, default in flags:
        state, row, note = status(names, family)
        if row is None:
            missing.setdefault(note, []).append(names[0])
            continue
        mine = "" if row.default is None or row.type is bool else _cell(row.default)
        theirs = "" if default is None else _cell(default)
        known.append(f"| {' '.join(f'`{n}`' for n in names)} | {state} | {theirs} | {mine} | "
                     f"{_cell(note)} |")
    lines = [f"### {title}", ""]
    if known:
        lines += ["| flag | status | Megatron default | gigatron default | in gigatron |",
                  "|---|---|---|---|---|"] + known + [""]
    if missing:
        lines += ["Not supported:", ""] + [
            f"- {reason}: {', '.join(f'`{n}`' for n in names)}"
            for reason, names in missing.items()] + [""]
    return lines


def _grouped(source: Dict[str, str]) -> Dict[str, Flags]:
    groups: Dict[str, Flags] = {}
    for family, names, default in entries(source):
        groups.setdefault(family, []).append((names, default))
    return groups


def _summary(label: str, groups: Dict[str, Flags]) -> List[str]:
    lines = [f"| {label} family | flags | supported | accepted without effect / selector | "
             "refused or not supported |", "|---|---|---|---|---|"]
    for family, flags in groups.items():
        states = [status(names, family)[0] for names, _ in flags]
        lines.append(f"| {family} | {len(states)} | {states.count(SUPPORTED)} | "
                     f"{states.count(NO_EFFECT) + states.count(SELECTOR)} | "
                     f"{states.count(NOT_SUPPORTED) + states.count(REFUSED)} |")
    return lines + [""]


def _own_flags() -> List[str]:
    megatron = {n for source in (MEGATRON_LM, MEGATRON_DEEPSPEED)
                for _, names, _ in entries(source) for n in names}
    lines = ["| flag | meaning |", "|---|---|"]
    for row in table():
        if row.flag and not megatron & set(row.spec.flags):
            lines.append(f"| {', '.join(f'`{f}`' for f in row.spec.flags)} | "
                         f"{_cell(row.spec.doc)} |")
    return lines + [""]


def megatron_markdown() -> str:
    """docs/MEGATRON.md."""
    mlm, mds = _grouped(MEGATRON_LM), _grouped(MEGATRON_DEEPSPEED)
    lines = ["# Megatron-LM and Megatron-DeepSpeed flags in gigatron", "",
             "Generated from the config table (`training/config/table.py`) and "
             "`training/config/megatron/catalog.py` "
             f"({MEGATRON_LM_SOURCE[0]} at {MEGATRON_LM_SOURCE[2][:8]}: every flag of its "
             f"pretrain_gpt.py; {MEGATRON_DEEPSPEED_SOURCE[0]} at "
             f"{MEGATRON_DEEPSPEED_SOURCE[2][:8]}: the flags it adds); do not edit by hand: "
             "`python -m gigatron.training.config.megatron.doc > docs/MEGATRON.md`.", "",
             f"Statuses: **{SUPPORTED}** (Megatron's meaning; the default too unless the "
             f"table below says otherwise), **{NO_EFFECT}** (the reason is given), "
             f"**{SELECTOR}** (chooses how, not what: the same numbers), **{REFUSED}**, "
             f"**{NOT_SUPPORTED}** (with why; an unknown flag is an error, never ignored).", "",
             "## Summary", ""]
    lines += _summary("Megatron-LM", mlm) + _summary("Megatron-DeepSpeed", mds)
    lines += ["## Defaults that differ from Megatron's", "",
              "| flag | Megatron | gigatron | why |", "|---|---|---|---|"]
    lines += [f"| `{flag}` | {_cell(theirs)} | {_cell(mine)} | "
              f"{_cell(DIFFERENT_DEFAULTS.get(flag, 'UNEXPLAINED'))} |"
              for flag, theirs, mine in default_differences()]
    lines += ["", "## Numbers that differ from Megatron-Core for the same flags", ""]
    lines += [f"- {note}" for note in NOTES] + [""]
    lines += ["## Megatron-LM flags, by family", ""]
    for family, flags in mlm.items():
        lines += _family_section(family, family, flags)
    lines += ["## Megatron-DeepSpeed's additional flags, by family", ""]
    for family, flags in mds.items():
        lines += _family_section(f"{family} (Megatron-DeepSpeed)", family, flags)
    lines += ["## gigatron's own flags (not Megatron's)", ""] + _own_flags()
    return "\n".join(lines)


if __name__ == "__main__":
    print(megatron_markdown(), end="")
