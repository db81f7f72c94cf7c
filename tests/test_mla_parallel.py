"""Multi-latent attention trains the same model in every layout as on one device: a tiny fp32
MLA GPT (query and key/value latents with their norms, YaRN with its softmax mscale, value
heads narrower than query/key heads) pretrained for 2 iterations by the real program
(pretrain.main on forked gloo ranks, --mock-data) logs the one-rank run's losses and ends
with its full parameters (tp slices gathered), within 1e-4 relative.

Layouts: tp2 without and with --sequence-parallel (the shared positional key's gradient
summed over tp: without that sum, as Megatron-Core's column-parallel down-projections
have it, tried: linear_kv_down_proj 2.0e-2 off at tp2), cp2 under p2p, all_gather and a2a
(the narrower values padded to the query/key head size for the cp blocks), cp4 under
a2a+p2p (--hierarchical-context-parallel-sizes 2 2: the padded heads through the all-to-all
and the ring), cp2 a2a x tp2 with sequence parallelism, pp2 with multi-token prediction (the
MTP layer an MLA layer on the last stage; its "mtp_1 loss" compared too), pp2 interleaved
(4 layers, 2 virtual stages), pp2 under the zero-bubble zb-h1 schedule (MLA's weight
gradients deferred), dp2 with ZeRO 3 and full recomputation, tp2 with selective
recomputation, ep2 with DeepSeek-V3's MoE block in small (sigmoid group-limited routing with
the expert bias and its updates, a shared expert, the first layer dense).
"""
from __future__ import annotations

import pytest

import json

from test_context_parallel import BASE, _relative
from test_moe_parallel import train_and_gather

RTOL = 1e-4
MLA = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 "
       "--qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --normalization RMSNorm "
       "--position-embedding-type rope --rope-type yarn --rotary-scaling-factor 4 "
       "--mscale-all-dim 1 --yarn-original-max-position-embeddings 8").split()
FOUR_LAYERS = ["--num-layers", "4"]
MTP = ("--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 "
       "--untie-embeddings-and-output-weights").split()
# DeepSeek-V3's MoE block in small: a dense first layer, sigmoid routing with the expert bias,
# group-limited top-2 from 2 of 4 groups, scaled weights, a shared expert
MOE = ("--num-experts 8 --moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 16 "
       "--moe-layer-freq [0,1] --moe-router-topk 2 --moe-router-score-function sigmoid "
       "--moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2 "
       "--moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --swiglu").split()

# name -> (ranks, flags, flags the one-rank reference shares)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"], ()),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ()),
    "cp2_p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"], ()),
    "cp2_all_gather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
                       ()),
    "cp2_a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], ()),
    "cp4_a2a_p2p_2x2": (4, "--context-parallel-size 4 --cp-comm-type a2a+p2p "
                           "--hierarchical-context-parallel-sizes 2 2".split(), ()),
    "pp2_mtp": (2, ["--pipeline-model-parallel-size", "2"], tuple(MTP)),
    "pp2_vp2": (2, "--pipeline-model-parallel-size 2 "
                   "--num-layers-per-virtual-pipeline-stage 1".split(), tuple(FOUR_LAYERS)),
    "dp2_zero3_recompute": (2, "--zero-stage 3 --recompute-granularity full "
                               "--recompute-method uniform --recompute-num-layers 1".split(), ()),
    "pp2_zb_h1": (2, "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1".split(),
                  tuple(FOUR_LAYERS)),
    "cp2_tp2_sp_a2a": (4, "--context-parallel-size 2 --cp-comm-type a2a "
                          "--tensor-model-parallel-size 2 --sequence-parallel".split(), ()),
    "ep2_moe": (2, ["--expert-model-parallel-size", "2"], tuple(MOE)),
    "tp2_selective": (2, ["--tensor-model-parallel-size", "2", "--recompute-granularity",
                          "selective"], ()),
}


def _losses(path):
    """Each logged iteration's (lm loss, mtp_1 loss) (the second None without MTP)."""
    with open(path) as f:
        return [(r["lm loss"], r.get("mtp_1 loss"))
                for r in map(json.loads, f) if r["type"] == "train"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(shared):
        if shared not in cache:
            metrics = str(tmp_path_factory.mktemp("one") / "one.jsonl")
            params = train_and_gather(1, BASE + MLA + list(shared), metrics)
            cache[shared] = params, _losses(metrics)
        return cache[shared]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_layout_trains_the_one_device_model(references, tmp_path, layout):
    ranks, flags, shared = LAYOUTS[layout]
    ref_params, ref_losses = references(shared)
    metrics = str(tmp_path / "metrics.jsonl")
    params = train_and_gather(ranks, BASE + MLA + list(shared) + flags, metrics)
    losses = _losses(metrics)
    assert len(losses) == len(ref_losses) > 0
    assert all((mtp is None) == ("--mtp-num-layers" not in shared) for _, mtp in ref_losses)
    loss_error = max(abs(a - b) / abs(b) for pair, ref in zip(losses, ref_losses)
                     for a, b in zip(pair, ref) if b is not None)
    assert set(params) - set(ref_params) <= {"output_layer.weight"}
    assert set(ref_params) <= set(params)
    assert any("linear_kv_down_proj" in name for name in params)
    if "--mtp-num-layers" in shared:  # the MTP layer is an MLA layer too
        assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight" \
            in ref_params
    errors = {n: _relative(params[n], ref_params[n]) for n in ref_params}
    worst = max(errors, key=errors.get)
    print(f"{layout}: loss error {loss_error:.2e}, param error {errors[worst]:.2e} ({worst})")
    assert loss_error <= RTOL and errors[worst] <= RTOL, (loss_error, worst, errors[worst])
