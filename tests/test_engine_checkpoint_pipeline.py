"""A PipelineModule's checkpoint is layout-free too: PipelineModule names each layer by its
global index ("3.fc1.weight") and a tied module by its key ("tied_modules.embed.weight",
saved once by the first stage), so a checkpoint saved at pp=2 loads at pp=1 and one saved at
pp=1 loads at pp=2 with interleaved virtual stages, and the run continues with the losses of
the uninterrupted pp=2 run. With dropout: seed_layers seeds each layer's dropout from the
stages' forward count, which the checkpoint carries (a resumed run that started counting
again would draw other masks).

Tolerance 1e-5 relative (1e-6 absolute) on each step's loss, as tests/test_pipeline_user_
model.py compares pp=2 with pp=1: the layouts differ in float rounding only (the tied
embedding's two gradients are summed over two stages). Another model (other layer names)
is one error naming the layers.
"""
import os

import torch

import gigatron  # noqa: F401  (imported once here: the forked ranks inherit it)
import pipe_user_model as um
from multirank import run_on_ranks

GLOBAL_MICRO, STEPS, SAVED_AT, DROPOUT = 4, 6, 3, 0.1
RTOL, ATOL = 1e-5, 1e-6


def engine_for(pp: int, virtual: int = 1, blocks: int = 4):
    import gigatron
    from gigatron.pipe import PipelineModule

    net = PipelineModule(um.layers(num_blocks=blocks, dropout=DROPOUT), num_stages=pp,
                         loss_fn=um.loss_fn, seed_layers=True, virtual_stages=virtual)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "gradient_accumulation_steps": GLOBAL_MICRO // net.dp_size,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 1}}
    return gigatron.initialize(model=net, config=config)[0]


def train(engine, upto: int) -> list:
    losses = []
    while engine.global_steps < upto:
        step = engine.global_steps
        batches = [um.micro_batch(step, j) for j in range(GLOBAL_MICRO)]
        losses.append(float(engine.train_batch(iter(batches))))
    return losses


def _pp2(rank, world, folder):
    reference = train(engine_for(2), STEPS)
    engine = engine_for(2)
    first = train(engine, SAVED_AT)
    engine.save_checkpoint(os.path.join(folder, "pp2"))
    continued = None
    if os.path.exists(os.path.join(folder, "pp1")):
        engine = engine_for(2, virtual=2)
        engine.load_checkpoint(os.path.join(folder, "pp1"))
        continued = train(engine, STEPS)
    return reference, first, continued


def _pp1(rank, world, folder):
    engine = engine_for(1)
    engine.load_checkpoint(os.path.join(folder, "pp2"))
    offset = engine.pipe.chunks[0].micro_offset
    continued = train(engine, STEPS)
    engine = engine_for(1)
    train(engine, SAVED_AT)
    engine.save_checkpoint(os.path.join(folder, "pp1"))
    try:
        engine_for(1, blocks=3).load_checkpoint(os.path.join(folder, "pp2"))
    except ValueError as err:
        return continued, offset, str(err)
    return continued, offset, None


def test_saved_at_pp2_loads_at_pp1_and_back(tmp_path):
    folder = str(tmp_path)
    reference, first, _ = run_on_ranks(_pp2, 2, folder, timeout=300)[0]
    assert first == reference[:SAVED_AT]
    continued, offset, wrong_model = run_on_ranks(_pp1, 1, folder, timeout=300)[0]
    assert offset == SAVED_AT * GLOBAL_MICRO  # every stage's forward count
    torch.testing.assert_close(torch.tensor(continued), torch.tensor(reference[SAVED_AT:]),
                               rtol=RTOL, atol=ATOL)
    # 3 blocks: layer 5 is the final norm here, a function without parameters in the
    # 4-block checkpoint, whose layer 4 is a block
    assert wrong_model is not None and "lacks '5.bias', '5.weight' of this module and " \
        "holds '4.fc1.bias', '4.fc1.weight', '4.fc2.bias' and" in wrong_model, wrong_model
    assert "pass load_module_strict=False" in wrong_model
    results = run_on_ranks(_pp2, 2, folder, timeout=300)  # pp=1 -> pp=2 x 2 virtual stages
    for reference_again, _, back in results:
        assert reference_again == reference
        torch.testing.assert_close(torch.tensor(back), torch.tensor(reference[SAVED_AT:]),
                                   rtol=RTOL, atol=ATOL)
