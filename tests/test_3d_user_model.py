"""3D parallelism for a user's own model: a `gigatron.pipe.PipelineModule` of the user's
layers (tied input/output embeddings across the first and last stage), split over tp by
`parallelize`, trained by `gigatron.initialize`'s pipeline engine with ZeRO stage 1 on
tp=2 x pp=2 x dp=2 (8 CPU ranks) equals the same layers trained by torch.optim.AdamW on one
device, step by step.

Tolerance: every full (tp-gathered) parameter within 1e-5 relative (L2 of the difference
over L2 of the reference), as tests/test_zero_gpt.py; the losses train_batch returns
within 1e-5 relative.
"""
import torch
import torch.nn.functional as F
from multirank import run_on_ranks
from torch import nn
from user_transformer import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, SEQ, VOCAB, Block

from gigatron.parallel.tensor import (ColumnParallel, LocalAttributes, TensorParallelPlan,
                                      copy_to_tensor_parallel_region,
                                      gather_from_tensor_parallel_region, gather_full_parameter,
                                      parallelize)

LAYERS, STEPS, MICRO, ACCUM, DP, LR, RTOL, BASE_SEED = 4, 3, 2, 4, 2, 1e-3, 1e-5, 1234


class Embed(nn.Module):
    """The tied table; the output layer reads `tok.weight` through `logits`."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.tok.weight.normal_(0.0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


def logits(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    """Output projection through the tied table; whole logits whether or not it is split."""
    group = getattr(embed.tok, "tp_group", None)
    part = F.linear(copy_to_tensor_parallel_region(x, group), embed.tok.weight)
    return gather_from_tensor_parallel_region(part, group)


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(SEQ, HIDDEN)
        with torch.no_grad():
            self.pos.weight.normal_(0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())


def pipeline_plan() -> TensorParallelPlan:
    """The user plan, for the PipelineModule's names (layers by index, tied_modules.<key>)."""
    return TensorParallelPlan({
        "tied_modules.embed.tok": "vocab_embedding",
        "*.attn": LocalAttributes(divide=("n_heads", "n_kv_heads")),
        "*.attn.qkv": ColumnParallel(fused=(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                            KV_HEADS * HEAD_DIM)),
        "*.attn.out": "row", "*.mlp.up": "column", "*.mlp.down": "row"})


def micro_batches(dp_rank):
    """This replica's micro-batches of every step, (inputs, labels) as DeepSpeed reads them."""
    g = torch.Generator().manual_seed(7)
    steps = [torch.randint(0, VOCAB, (DP, ACCUM, MICRO, SEQ + 1), generator=g)
             for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for step in steps for t in step[dp_rank]]


def _three_d(rank, world):
    import gigatron
    from gigatron.pipe import LayerSpec, PipelineModule, TiedLayerSpec, Topology
    layers = [TiedLayerSpec("embed", Embed, tied_weight_attr="tok.weight"),
              LayerSpec(Positions), *[LayerSpec(Block) for _ in range(LAYERS)],
              LayerSpec(nn.LayerNorm, HIDDEN),
              TiedLayerSpec("embed", Embed, forward_fn=logits, tied_weight_attr="tok.weight")]
    net = PipelineModule(layers, topology=Topology(tp=2, dp=DP, pp=2), loss_fn=loss_fn,
                         seed_layers=True, base_seed=BASE_SEED)
    parallelize(net, pipeline_plan(), net.groups)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 1}}
    engine, _, _, _ = gigatron.initialize(model=net, config=config)
    data = iter(micro_batches(net.dp_rank))
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    full = {n: gather_full_parameter(p, net.groups.tp) for n, p in net.named_parameters()}
    return net.stage_id, losses, full


def single_device():
    """The same layers, seeded as seed_layers seeds them, trained by torch on one device."""
    from gigatron.engine.pipe.specs import set_random_seed
    model = nn.Module()
    set_random_seed(BASE_SEED + 0)
    model.tied_modules = nn.ModuleDict({"embed": Embed()})
    layers = [Positions] + [Block] * LAYERS + [lambda: nn.LayerNorm(HIDDEN)]
    for index, make in enumerate(layers, start=1):
        set_random_seed(BASE_SEED + index)
        model.add_module(str(index), make())
    run = [model.tied_modules.embed] + [getattr(model, str(i)) for i in range(1, len(layers) + 1)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    batches = [micro_batches(d) for d in range(DP)]
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for d in range(DP):
            for inputs, labels in batches[d][step * ACCUM:(step + 1) * ACCUM]:
                x = inputs
                for layer in run:
                    x = layer(x)
                loss = loss_fn(logits(model.tied_modules.embed, x), labels) / (DP * ACCUM)
                loss.backward()
                total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_tp2_pp2_dp2_user_model_with_parallelize_equals_single_device():
    results = run_on_ranks(_three_d, 8, timeout=300)
    ref_losses, ref = single_device()
    seen = set()
    for stage, losses, full in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL,
                                   atol=0.0)
        for name, value in full.items():
            diff = float((value - ref[name]).norm() / ref[name].norm())
            assert diff <= RTOL, f"stage {stage} {name}: {diff:.2e}"
            seen.add(name)
    assert seen == set(ref), f"parameters no stage holds: {sorted(set(ref) - seen)}"
