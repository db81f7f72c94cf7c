"""The plan as text for people and as JSON for programs (`gigatron plan [--json]`)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from gigatron.training.plan.memory import GIB, StageMemory, expert_data_parallel_size
from gigatron.training.plan.planner import Plan
from gigatron.training.plan.ranking import TIE_TOLERANCE, rank_with_ties, refusal_groups
from gigatron.training.plan.search import Candidate

SCHEMA = "gigatron-plan-v1"
ZERO_BUBBLE = {"zb-h1": "ZB-H1", "zbv": "ZBV"}


def _recompute(plan: Plan) -> str:
    c = plan.run.model
    assert c is not None
    if c.recompute_granularity == "full":
        return f"full ({c.recompute_method}, {c.recompute_num_layers})"
    if c.selective_ac_option or c.recompute_granularity == "selective" and \
            c.recompute_modules not in (None, ["core_attn"]):  # not Megatron's default
        return f"selective ({c.selective_ac_option or ', '.join(c.recompute_modules or [])})"
    return c.recompute_granularity or "none"


def layout_dict(plan: Plan) -> Dict[str, Any]:
    p, t, z = plan.run.parallel, plan.run.train, plan.run.zero
    return {"tp": p.tp, "pp": p.pp, "dp": p.dp,
            "virtual_chunks": plan.stages and len(plan.stages[0].in_flight),
            "zero_stage": z.zero_stage, "optimizer_offload": z.offload_optimizer == "cpu",
            "sequence_parallel": p.sequence_parallel, "recompute": _recompute(plan),
            "micro_batch_size": t.micro_batch_size, "num_microbatches": t.num_microbatches,
            "global_batch_size": t.global_batch_size, **_expert_layout(plan),
            **_context_layout(plan), **_zero_bubble_layout(plan)}


def _zero_bubble_layout(plan: Plan) -> Dict[str, Any]:
    """The zero-bubble schedule's name (1f1b and interleaved plans print as before)."""
    schedule = plan.run.parallel.pipeline_schedule
    return {"pipeline_schedule": schedule} if schedule in ZERO_BUBBLE else {}


def _schedule_name(plan: Plan, virtual_chunks: int) -> str:
    """The schedule line's name: ZB-H1 or ZBV, else (interleaved) 1F1B or none."""
    p = plan.run.parallel
    if p.pipeline_schedule in ZERO_BUBBLE:
        return ZERO_BUBBLE[p.pipeline_schedule]
    return "interleaved 1F1B" if virtual_chunks > 1 else "1F1B" if p.pp > 1 else "none"


def _context_layout(plan: Plan) -> Dict[str, Any]:
    """cp and its comm type (cp > 1 only: a plan without cp prints as before)."""
    p = plan.run.parallel
    if p.context_parallel_size == 1:
        return {}
    sizes = p.hierarchical_context_parallel_sizes if p.cp_comm_type == "a2a+p2p" else None
    return {"cp": p.context_parallel_size, "cp_comm_type": p.cp_comm_type,
            **({"hierarchical_context_parallel_sizes": list(sizes)} if sizes else {})}


def _expert_layout(plan: Plan) -> Dict[str, Any]:
    """The expert layers' sizes (MoE models only: a dense plan's JSON is unchanged)."""
    c, p = plan.run.model, plan.run.parallel
    if c is None or c.num_moe_experts is None:
        return {}
    etp = p.etp or p.tp
    shards = p.dp * p.context_parallel_size  # experts fold over cp x dp
    return {"ep": p.ep, "etp": etp, "edp": expert_data_parallel_size(p.tp, shards, p.ep, etp),
            "num_experts": c.num_moe_experts, "moe_router_topk": c.moe_router_topk,
            "moe_token_dispatcher_type": c.moe_token_dispatcher_type}


def stage_dict(m: StageMemory) -> Dict[str, Any]:
    s = m.state
    return {"pp_rank": m.pp_rank, "parameters": m.parameters,
            "bytes": {"params": s.params, "grads": s.grads, "master_params": s.master_params,
                      "optimizer_state": s.optimizer_state, "activations": m.activations,
                      "transient": m.transient, "peak": m.peak},
            "host_bytes": s.host_side if s.offloaded else 0,
            "microbatches_in_flight": m.in_flight, **_w_stash_stage(m), **_expert_stage(m)}


def _w_stash_stage(m: StageMemory) -> Dict[str, Any]:
    """The W stashes held with the activations (split backward only: zb-h1, zbv)."""
    return {"w_stash_in_flight": m.w_stash} if any(m.w_stash) else {}


def _expert_stage(m: StageMemory) -> Dict[str, Any]:
    """The routed experts' share of a stage's parameters and state (MoE models only)."""
    e = m.expert_state
    if e is None:
        return {}
    return {"expert_parameters": m.expert_parameters,
            "expert_bytes": {"params": e.params, "grads": e.grads,
                             "master_params": e.master_params,
                             "optimizer_state": e.optimizer_state}}


def plan_dict(plan: Plan) -> Dict[str, Any]:
    """The JSON form of one plan (schema SCHEMA; every size in bytes, every time in s)."""
    hw, c, r = plan.hardware, plan.cost, plan.rates
    return {"schema": SCHEMA, "gpu": {"key": hw.key, "name": hw.name,
                                      "memory_bytes": plan.capacity_bytes,
                                      "peak_tflops": dict(hw.peak_tflops),
                                      "hbm_gbps": hw.hbm_gbps,
                                      "intra_node_gbps": hw.intra_node_gbps,
                                      "inter_node_gbps": hw.inter_node_gbps,
                                      "gpus_per_node": hw.gpus_per_node},
            "num_gpus": plan.run.parallel.world_size, "layout": layout_dict(plan),
            "stages": [stage_dict(m) for m in plan.stages],
            "fits": plan.fits, "peak_bytes": plan.peak_bytes,
            "reserved_bytes": plan.reported_bytes, "device_bytes": plan.device_bytes,
            "step": {"forward_s": c.forward, "backward_s": c.backward,
                     "tp_communication_s": c.tp_communication, "tp_bytes": c.tp_bytes,
                     "pipeline_s": c.pipeline, "bubble": c.bubble,
                     "dp_communication_s": c.dp_communication, "dp_exposed_s": c.dp_exposed,
                     "dp_bytes": c.dp_bytes, "optimizer_s": c.optimizer, "step_s": c.step,
                     "executed_flops_per_gpu": c.gemm_flops, **_expert_step(plan),
                     **_context_step(plan), **_muon_step(plan)},
            "rates": {"tokens_per_s": r.tokens_per_s,
                      "model_tflops_per_gpu": r.model_tflops_per_gpu,
                      "executed_tflops_per_gpu": r.hardware_tflops_per_gpu, "mfu": r.mfu}}


def _expert_step(plan: Plan) -> Dict[str, Any]:
    if not _expert_layout(plan):
        return {}
    return {"expert_communication_s": plan.cost.expert_communication,
            "expert_bytes": plan.cost.expert_bytes}


def _muon_step(plan: Plan) -> Dict[str, Any]:
    from gigatron.training.plan.muon import muon_cost

    muon = muon_cost(plan.run, plan.hardware)
    if muon is None:
        return {}
    return {"muon_newton_schulz_flops": muon.flops, "muon_exchange_bytes": muon.exchange_bytes,
            "muon_gather_bytes": muon.gather_bytes, "muon_s": muon.seconds}


def _context_step(plan: Plan) -> Dict[str, Any]:
    if not _context_layout(plan):
        return {}
    return {"cp_communication_s": plan.cost.cp_communication,
            "cp_exposed_s": plan.cost.cp_exposed, "cp_bytes": plan.cost.cp_bytes}


def search_dict(ranked: Sequence[Candidate], refused: Sequence[Candidate],
                tie_tolerance: float = TIE_TOLERANCE) -> Dict[str, Any]:
    """Every layout: "ranked" fastest first, each with its "tie_group" (ranking.py: the text
    shows a group's layouts fewest model-parallel ranks first, then least memory), "refused"
    each with its reason, "refused_by_reason" one example and the count per reason."""
    group = {id(c): g for g, c in rank_with_ties(ranked, tie_tolerance)}
    return {"schema": SCHEMA, "tie_tolerance": tie_tolerance,
            "ranked": [{**plan_dict(c.plan), "tie_group": group[id(c)]} for c in ranked
                       if c.plan is not None],
            "refused": [{"layout": _layout_keys(c), "reason": c.reason} for c in refused],
            "refused_by_reason": [{"count": g.count, "layout": _layout_keys(g.example),
                                   "reason": g.example.reason}
                                  for g in refusal_groups(refused)]}


def _layout_keys(candidate: Candidate) -> Dict[str, Any]:
    """A refused layout's sizes (ep only for MoE, cp only above 1: as before cp existed)."""
    return {k: v for k, v in candidate.layout.__dict__.items()
            if v is not None and not (k == "cp" and v == 1)}


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _context_sizes(plan: Plan) -> str:
    lay = _context_layout(plan)
    sizes = "x".join(map(str, lay.get("hierarchical_context_parallel_sizes", [])))
    return f" cp={lay['cp']} ({lay['cp_comm_type']}{' ' + sizes if sizes else ''})" if lay \
        else ""


def _expert_sizes(plan: Plan) -> str:
    lay = _expert_layout(plan)
    return f" ep={lay['ep']} etp={lay['etp']} edp={lay['edp']}" if lay else ""


def describe(plan: Plan) -> str:
    """The plan as text: header, memory per stage, the step."""
    hw, run = plan.hardware, plan.run
    c, p, t, z = run.model, run.parallel, run.train, run.zero
    assert c is not None
    lay = layout_dict(plan)
    lines = [
        f"plan: {p.world_size} x {hw.key} ({hw.name}, {hw.memory_gib} GiB), tp={p.tp} "
        f"pp={p.pp} dp={p.dp}{_context_sizes(plan)}{_expert_sizes(plan)}"
        f"{' sequence-parallel' if p.sequence_parallel else ''}, "
        f"zero stage {z.zero_stage}{' + optimizer offload' if lay['optimizer_offload'] else ''}"
        f", recompute {lay['recompute']}",
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x dp {p.dp} x "
        f"{t.num_microbatches} micro-batches, schedule "
        f"{_schedule_name(plan, lay['virtual_chunks'])}",
        "", "memory per rank, GiB (model state exactly as ZeRO lays it out; activations at the "
        "schedule's high point):",
        f"  {'stage':>5} {'params':>14} {'weights':>8} {'grads':>8} {'master':>8} "
        f"{'optim':>8} {'activ':>8} {'in flight':>10} {'transient':>9} {'peak':>8}"]
    for m in plan.stages:
        s = m.state
        lines.append(f"  {m.pp_rank:>5} {m.parameters:>14,} {_gib(s.params):>8} "
                     f"{_gib(s.grads):>8} {_gib(s.master_params):>8} "
                     f"{_gib(s.optimizer_state):>8} {_gib(m.activations):>8} "
                     f"{_in_flight(m):>10} {_gib(m.transient):>9} "
                     f"{_gib(m.peak):>8}")
    lines += _expert_lines(plan)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  peak {_gib(plan.peak_bytes)} GiB allocated (max_memory_allocated), "
                 f"{_gib(plan.reported_bytes)} reserved by the caching allocator "
                 f"(max_memory_reserved), {_gib(plan.device_bytes)} on the device with the "
                 f"CUDA context and NCCL buffers, of {_gib(plan.capacity_bytes)}: {verdict}"
                 + (" (master weights and optimizer state in host memory)"
                    if lay["optimizer_offload"] else ""))
    cost, rates = plan.cost, plan.rates
    lines += ["", "step (slowest stage):",
              f"  forward {cost.forward * 1e3:.1f} ms + backward {cost.backward * 1e3:.1f} ms "
              f"per micro-batch (tensor-parallel collectives {cost.tp_communication * 1e3:.1f}"
              f" ms of it, {cost.tp_bytes / GIB:.2f} GiB per step)",
              f"  pipeline {cost.pipeline:.3f} s, bubble {cost.bubble:.3f} of busy time",
              f"  data-parallel {cost.dp_bytes / GIB:.2f} GiB per rank, "
              f"{cost.dp_communication * 1e3:.1f} ms ({cost.dp_exposed * 1e3:.1f} ms exposed)"
              f"; optimizer step {cost.optimizer * 1e3:.1f} ms",
              f"  step {cost.step:.3f} s: {rates.tokens_per_s:,.0f} tokens/s "
              f"({rates.tokens_per_s / plan.run.parallel.world_size:,.0f} per GPU), "
              f"{rates.model_tflops_per_gpu:.1f} model TFLOP/s per GPU "
              f"({rates.hardware_tflops_per_gpu:.1f} executed), MFU {rates.mfu:.1%}"
              f"{' on active parameters' if lay.get('ep') else ''}"]
    if lay.get("cp"):
        lines.insert(-1, f"  context-parallel exchange ({lay['cp_comm_type']}) "
                         f"{cost.cp_bytes / GIB:.2f} GiB per rank, "
                         f"{cost.cp_communication * 1e3:.1f} ms per step on the link "
                         f"({cost.cp_exposed * 1e3:.1f} ms exposed)")
    muon = _muon_step(plan)
    if muon:
        lines.insert(-1, f"  Muon: Newton-Schulz {muon['muon_newton_schulz_flops'] / 1e12:.2f} "
                         f"TFLOP per rank, layer-wise exchange "
                         f"{muon['muon_exchange_bytes'] / GIB:.2f} GiB and tp traffic "
                         f"{muon['muon_gather_bytes'] / GIB:.2f} GiB per rank, "
                         f"{muon['muon_s'] * 1e3:.1f} ms of the optimizer step (docs/MUON.md)")
    if lay.get("ep"):
        lines.insert(-1, f"  expert token exchange ({lay['moe_token_dispatcher_type']}) "
                         f"{cost.expert_bytes / GIB:.2f} GiB per rank, "
                         f"{cost.expert_communication * 1e3:.1f} ms per step (not overlapped)")
    return "\n".join(lines)


def _expert_lines(plan: Plan) -> List[str]:
    """Per stage: the routed experts' parameters and state on one rank."""
    lay = _expert_layout(plan)
    if not lay:
        return []
    out = [f"  routed experts ({lay['num_experts']} per MoE layer, top-{lay['moe_router_topk']}"
           f"; ep={lay['ep']} etp={lay['etp']}, state sharded over edp={lay['edp']}):"]
    for m in plan.stages:
        e = m.expert_state
        state = e.params + e.grads + e.master_params + e.optimizer_state if e else 0
        out.append(f"  {m.pp_rank:>5} {m.expert_parameters:>14,} parameters, "
                   f"{_gib(state)} GiB of the model state")
    return out


def describe_search(ranked: Sequence[Candidate], refused: Sequence[Candidate], top: int,
                    verbose: bool = False, tie_tolerance: float = TIE_TOLERANCE) -> str:
    """Ranked layouts (fastest first, ties broken as ranking.py says, and said so) and the
    refused ones: one line per reason with its count and an example, every one if
    `verbose`."""
    lines = [f"{len(ranked)} layouts fit, {len(refused)} refused; fastest first, but steps "
             f"within {tie_tolerance:.0%} of each other tie",
             "(the speed model's precision, docs/PLAN.md): fewer model-parallel ranks "
             "(tp x pp x cp), then less memory, first; '~' marks a tie with the line above"]
    shown = rank_with_ties(ranked, tie_tolerance)
    for i, (group, cand) in enumerate(shown[:top], 1):
        assert cand.plan is not None
        r, cost = cand.plan.rates, cand.plan.cost
        tied = "~" if i > 1 and shown[i - 2][0] == group else " "
        lines.append(f"  {i:>3}.{tied}{cand.layout.describe():<56} step "
                     f"{cost.step * 1e3:10.1f} ms  {r.model_tflops_per_gpu:7.1f} TFLOP/s/GPU  "
                     f"MFU {r.mfu:6.1%}  peak {cand.plan.peak_bytes / GIB:6.1f} GiB")
    if len(ranked) > top:
        lines.append(f"  ... {len(ranked) - top} more (--top N shows more, --json all)")
    if verbose:
        lines.append("refused:")
        lines += [f"  {cand.layout.describe():<56} {cand.reason}" for cand in refused]
    elif refused:
        groups = refusal_groups(refused)
        lines.append(f"refused, {len(groups)} reason{'s' if len(groups) > 1 else ''} (layouts, "
                     f"one example; --verbose lists every layout):")
        lines += [f"  {g.count:>5} e.g. {g.example.layout.describe():<56} {g.example.reason}"
                  for g in groups]
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def _in_flight(m: StageMemory) -> str:
    """'3' or, with W stashes held too (split backward), '3+1W'."""
    held = '+'.join(map(str, m.in_flight))
    return held + (f"+{sum(m.w_stash)}W" if any(m.w_stash) else "")


def _stash_note(m: StageMemory) -> str:
    """' (3 micro-batches' + 1 W stash)': what a split backward's activations hold."""
    if not any(m.w_stash):
        return ""
    return f" ({sum(m.in_flight)} micro-batches' + {sum(m.w_stash)} W stash)"


def startup_lines(stages: List[StageMemory]) -> List[str]:
    """The banner's memory prediction, one line per pipeline stage."""
    out = []
    for m in stages:
        s = m.state
        out.append(f"memory plan, stage {m.pp_rank}: peak {_size(m.peak)} per rank = weights "
                   f"{_size(s.params)} + grads {_size(s.grads)} + master "
                   f"{_size(s.master_params)} + optimizer {_size(s.optimizer_state)}"
                   f"{' (in host memory)' if s.offloaded else ''} + activations "
                   f"{_size(m.activations)}{_stash_note(m)} + transient {_size(m.transient)}")
    return out


def measured_lines(planned: Dict[int, float], measured: Dict[int, float]) -> List[str]:
    """'memory, stage r: planned X, measured peak Y (+d%)' for each stage in both."""
    out = []
    for stage in sorted(set(planned) & set(measured)):
        want, got = planned[stage], measured[stage]
        diff = f" ({(got - want) / want:+.0%})" if want > 0 else ""
        out.append(f"memory, stage {stage}: planned peak {_size(want)}, measured peak "
                   f"{_size(got)}{diff} (the allocator's max_memory_allocated)")
    return out
