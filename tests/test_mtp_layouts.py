"""Multi-token prediction (--mtp-num-layers, DeepSeek-V3 / Megatron-Core) trains the same
model in every layout as on one device: a tiny fp32 RoPE GPT with two MTP depths
(--mtp-loss-scaling-factor 0.3) pretrained by the real program (pretrain.main on forked gloo
ranks, --mock-data) logs the one-rank run's "lm loss" and "mtp_1 loss" / "mtp_2 loss" and
ends with its full parameters (tp slices gathered), within 1e-4 relative.

Layouts: pp2 with the word embedding tied (the last stage's MTP embedding is the output
weight's copy, synced with the first stage's) and untied (DeepSeek-V3's: the last stage keeps
a copy of the embedding, synced the same way, besides its own output layer), tp2 with
sequence parallelism (eh_proj gathered over tp, then split back over the sequence), pp2
interleaved (4 layers, 2 virtual stages) and pp2 under zb-h1 (weight gradients deferred)
untied, dp2 with ZeRO 3 and full recomputation, ep2 with
DeepSeek-V3's MoE block in small (the last decoder layer MoE, so the MTP layer is one too:
its experts split over ep, its expert bias updated).
"""
from __future__ import annotations

import json

import pytest

from test_context_parallel import GPT, ROPE, _relative
from test_mla_parallel import MOE
from test_moe_parallel import train_and_gather

RTOL = 1e-4
MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
UNTIED = ("--untie-embeddings-and-output-weights",)
FOUR_LAYERS = ("--num-layers", "4")
NAMES = ("lm loss", "mtp_1 loss", "mtp_2 loss")

# name -> (ranks, flags, flags the one-rank reference shares)
LAYOUTS = {
    "pp2_tied": (2, ["--pipeline-model-parallel-size", "2"], ()),
    "pp2_untied": (2, ["--pipeline-model-parallel-size", "2"], UNTIED),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ()),
    "ep2_moe": (2, ["--expert-model-parallel-size", "2"], tuple(MOE)),
    "dp2_zero3_recompute": (2, "--zero-stage 3 --recompute-granularity full "
                               "--recompute-method uniform --recompute-num-layers 1".split(), ()),
    "pp2_vp2_untied": (2, "--pipeline-model-parallel-size 2 "
                          "--num-layers-per-virtual-pipeline-stage 1".split(),
                       UNTIED + FOUR_LAYERS),
    "pp2_zb_h1_untied": (2, "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1".split(),
                         UNTIED + FOUR_LAYERS),
}


def _records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["type"] == "train"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(shared):
        if shared not in cache:
            metrics = str(tmp_path_factory.mktemp("one") / "one.jsonl")
            params = train_and_gather(1, GPT + ROPE + MTP + list(shared), metrics)
            cache[shared] = params, _records(metrics)
        return cache[shared]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_layout_trains_the_one_device_model(references, tmp_path, layout):
    ranks, flags, shared = LAYOUTS[layout]
    ref_params, ref_records = references(shared)
    metrics = str(tmp_path / "metrics.jsonl")
    params = train_and_gather(ranks, GPT + ROPE + MTP + list(shared) + flags, metrics)
    records = _records(metrics)
    assert len(records) == len(ref_records) > 0
    loss_error = max(abs(r[n] - q[n]) / abs(q[n])
                     for r, q in zip(records, ref_records) for n in NAMES)
    assert {"mtp.layers.1.eh_proj.weight", "mtp.layers.0.transformer_layer."
            "self_attention.linear_qkv.weight"} <= set(ref_params)
    if "--num-experts" in shared:
        assert any(n.startswith("mtp.layers.1.transformer_layer.mlp.experts.")
                   for n in ref_params)
    assert set(ref_params) <= set(params)
    errors = {n: _relative(params[n], ref_params[n]) for n in ref_params}
    worst = max(errors, key=errors.get)
    print(f"{layout}: loss error {loss_error:.2e}, param error {errors[worst]:.2e} ({worst})")
    assert loss_error <= RTOL and errors[worst] <= RTOL, (loss_error, worst, errors[worst])
