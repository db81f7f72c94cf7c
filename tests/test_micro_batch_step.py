"""The executor runs any model through its `MicroBatchStep`: it reads no batch key itself,
back-propagates the last stage's auxiliary losses and the losses layers add on any stage
with the micro-batch loss's scale, and reports them apart from the returned losses.

One process: one pipeline stage holding two virtual chunks (the interleaved schedule with
pp=1), so chunk 0's output travels through p2p to chunk 1 and its layer losses must be
back-propagated on the non-last stage's own path (the output anchor). Reference: the same
modules run end to end with plain autograd. Tolerance: rtol 1e-6 (fp32; the pipeline
accumulates the same terms in another order).
"""
import pytest
import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.losses import LayerLosses, masked_mean_loss
from gigatron.models.pipeline_chunks import GPTMicroBatchStep
from gigatron.parallel.pipeline.executor import PipelineExecutor
from gigatron.parallel.pipeline.interfaces import StageLoss
from gigatron.parallel.pipeline.p2p import PipelineP2P
from gigatron.parallel.pipeline.schedules import build_schedule

RTOL = 1e-6
LAYER_WEIGHT, AUX_WEIGHT = 0.3, 0.2


class LoopbackP2P:
    """Messages a rank sends itself (pp=1, two virtual chunks), detached as a real p2p's."""

    def __init__(self) -> None:
        self.queue = []

    def communicate(self, sends, recv_from):
        self.queue += [tensor.detach().clone() for tensor, _ in sends]
        received, self.queue = self.queue[:len(recv_from)], self.queue[len(recv_from):]
        return received


class ToyChunk(torch.nn.Module):
    """A linear layer that may leave a loss of its own in `layer_losses` (a router's)."""

    def __init__(self, seed: int, adds_loss: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(4, 4)
        self.adds_loss = adds_loss
        self.layer_losses = LayerLosses()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        if self.adds_loss:
            self.layer_losses.add("balance", LAYER_WEIGHT * y.pow(2).mean())
        return y


class ToyStep:
    """A MicroBatchStep on keys the executor has never heard of: `features`, `target`."""

    def chunk_inputs(self, batch, received, last):
        return {"x": batch["features"] if received is None else received}

    def loss(self, output, batch):
        mse = (output - batch["target"]).pow(2).mean()
        return StageLoss(mse, {"z_loss": AUX_WEIGHT * output.abs().mean()})

    def layer_losses(self, chunk):
        return chunk.layer_losses.take()


def toy_batches(n):
    g = torch.Generator().manual_seed(7)
    return [{"features": torch.randn(3, 4, generator=g), "target": torch.randn(3, 4, generator=g)}
            for _ in range(n)]


def toy_reference(batches, scale):
    """Plain autograd over both chunks: grads of scale x (loss + aux + layer loss) summed."""
    chunks = [ToyChunk(0, adds_loss=True), ToyChunk(1, adds_loss=False)]
    losses, aux = [], {"balance": 0.0, "z_loss": 0.0}
    for batch in batches:
        out = chunks[1](chunks[0](batch["features"]))
        balance = chunks[0].layer_losses.take()["balance"]
        stage = ToyStep().loss(out, batch)
        ((stage.loss + stage.aux_losses["z_loss"] + balance) * scale).backward()
        losses.append(stage.loss.detach())
        aux["balance"] += balance.item()
        aux["z_loss"] += stage.aux_losses["z_loss"].item()
    return losses, aux, [p.grad for c in chunks for p in c.parameters()]


def toy_executor():
    chunks = [ToyChunk(0, adds_loss=True), ToyChunk(1, adds_loss=False)]
    return chunks, PipelineExecutor(chunks, LoopbackP2P(), 0, [0], micro_batch_step=ToyStep())


def test_auxiliary_and_layer_losses_are_back_propagated_scaled_and_reported_apart():
    batches = toy_batches(4)
    loss_scale, divisor = 4.0, 3.0  # as fp16's scaler and --calculate-per-token-loss set them
    ref_losses, ref_aux, ref_grads = toy_reference(batches, loss_scale / divisor)
    chunks, executor = toy_executor()
    losses = executor.run(build_schedule(0, 1, 4, 2), batches, loss_scale=loss_scale,
                          loss_divisor=divisor)
    # the returned losses are the micro-batch losses alone (the logged 'lm loss')
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=0)
    assert set(executor.aux_losses) == {"balance", "z_loss"}
    for name, value in executor.aux_losses.items():
        assert not value.requires_grad
        assert value.item() == pytest.approx(ref_aux[name], rel=RTOL)
    grads = [p.grad for c in chunks for p in c.parameters()]
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-8)


def test_forward_only_reports_layer_losses_and_leaves_none_behind():
    batches = toy_batches(2)
    chunks, executor = toy_executor()
    with torch.no_grad():
        losses = executor.run(build_schedule(0, 1, 2, 2, forward_only=True), batches)
    assert len(losses) == 2 and set(executor.aux_losses) == {"balance", "z_loss"}
    assert chunks[0].layer_losses.take() == {}  # taken after each forward
    assert all(p.grad is None for c in chunks for p in c.parameters())
    evaluated = {name: value.item() for name, value in executor.aux_losses.items()}
    executor.run(build_schedule(0, 1, 2, 2), batches)  # same parameters, same losses
    for name, value in executor.aux_losses.items():  # this run's alone, not both runs'
        assert value.item() == pytest.approx(evaluated[name], rel=RTOL)


def test_layer_losses_take_sums_by_name_and_refuses_non_scalars():
    losses = LayerLosses()
    losses.add("balance", torch.tensor(1.0))
    losses.add("balance", torch.tensor([2.0]))
    taken = losses.take()
    assert taken["balance"].item() == 3.0 and taken["balance"].shape == ()
    assert losses.take() == {}
    with pytest.raises(ValueError, match="'balance' must be a scalar"):
        losses.add("balance", torch.ones(2))


def gpt_config():
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                             vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             untie_embeddings_and_output_weights=True)


def gpt_batches(n):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 100, (2, 17), generator=g)
        mask = (torch.rand(2, 16, generator=g) > 0.3).float()
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def add_router_loss(model):
    """A stand-in for a mixture-of-experts router: layer 1 leaves a loss in its model's
    `layer_losses`."""
    def hook(module, args, output):
        model.layer_losses.add("load_balancing", 0.5 * output.pow(2).mean())
    return model.decoder.layers["1"].register_forward_hook(hook)


def test_gpt_layer_losses_are_back_propagated_on_the_chunk_that_holds_the_layer():
    config, batches = gpt_config(), gpt_batches(2)
    full = GPTModel(config, seed=5)
    add_router_loss(full)
    router = 0.0
    for batch in batches:
        per_token = full(input_ids=batch["input_ids"], labels=batch["labels"])
        extra = full.layer_losses.take()["load_balancing"]
        ((masked_mean_loss(per_token, batch) + extra) / len(batches)).backward()
        router += extra.item()
    chunks = [GPTModel(config, pre_process=True, post_process=False, layer_range=[0, 1],
                       seed=5),
              GPTModel(config, pre_process=False, post_process=True, layer_range=[2, 3],
                       seed=5)]  # the router's layer 1 is on the non-last chunk
    add_router_loss(chunks[0])
    shape = (config.seq_length, 2, config.hidden_size)
    executor = PipelineExecutor(chunks, PipelineP2P(shape, torch.float32, torch.device("cpu")),
                                0, [0], micro_batch_step=GPTMicroBatchStep())
    executor.run(build_schedule(0, 1, 2, 2), batches)
    assert executor.aux_losses["load_balancing"].item() == pytest.approx(router, rel=RTOL)
    want = dict(full.named_parameters())
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            torch.testing.assert_close(param.grad, want[name].grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_gpt_step_reads_megatron_batches_by_stage():
    step, batch = GPTMicroBatchStep(), gpt_batches(1)[0]
    batch["position_ids"] = torch.arange(16).expand(2, 16)
    hidden = torch.zeros(16, 2, 32)
    assert set(step.chunk_inputs(batch, None, last=False)) == {"input_ids", "position_ids"}
    # every stage takes the positions and packed documents' boundaries the batch carries
    assert set(step.chunk_inputs(batch, hidden, last=False)) == {"hidden_states",
                                                                 "position_ids"}
    del batch["position_ids"]
    assert set(step.chunk_inputs(batch, hidden, last=True)) == {"hidden_states", "labels"}
    batch["cu_seqlens"] = torch.tensor([[0, 16] + [16] * 15] * 2)
    assert set(step.chunk_inputs(batch, hidden, last=False)) == {"hidden_states",
                                                                 "cu_seqlens"}
    per_token = torch.rand(2, 16)
    mask = batch["loss_mask"]
    assert step.loss(per_token, batch).loss.item() == pytest.approx(
        ((per_token * mask).sum() / mask.sum()).item())
    summed = GPTMicroBatchStep(per_token_loss=True).loss(per_token, batch)
    assert summed.loss.item() == pytest.approx((per_token * mask).sum().item())
    assert summed.aux_losses == {}
