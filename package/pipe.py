"""DeepSpeed's `deepspeed.pipe` for gigatron: pipeline parallelism for your own model.

    from gigatron.pipe import PipelineModule, LayerSpec, TiedLayerSpec
    net = PipelineModule(layers=[...], num_stages=2, loss_fn=loss_fn)
    engine, _, _, _ = gigatron.initialize(model=net, config=ds_config)
    loss = engine.train_batch(data_iter)

`Topology` (gigatron.parallel.topology) takes the place of DeepSpeed's ProcessTopology
classes: `PipelineModule(layers, topology=Topology(tp=2, dp=2, pp=2))`. The implementation
lives in gigatron/engine/pipe/; see examples/
pipeline_user_model.py for a whole script.
"""
from gigatron.engine.pipe.module import PipelineModule
from gigatron.engine.pipe.specs import LayerSpec, TiedLayerSpec
from gigatron.engine.pipe.engine import PipelineEngine
from gigatron.parallel.topology import Topology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineEngine", "Topology"]
