"""`zero_optimization.offload_optimizer`: the one reader of this section, for pretrain_gpt.py's
--deepspeed-config (--optimizer-cpu-offload) and `gigatron.initialize` (ZeroConfig).

"cpu" keeps the fp32 master weights and optimizer state in host memory and steps there;
"nvme" does the same (NVMe offload is not implemented: host memory instead, with an info
line); "none" (DeepSpeed's default) keeps them on the accelerator. The section's other keys
only tune DeepSpeed's offload (pinned buffers, NVMe paths, ...): accepted with an info line.
"""
from __future__ import annotations

from typing import Any, List

from gigatron.training.config.deepspeed.keys import SPEED_ONLY
from gigatron.training.config.spelling import did_you_mean

OFFLOAD_KEY = "zero_optimization.offload_optimizer"
_DEVICES = ("cpu", "nvme", "none")


def offload_optimizer_device(section: Any, info: List[str], problems: List[str]) -> str:
    """ZeroConfig.offload_optimizer ('cpu' or 'none') of the section's device; info lines for
    what is accepted without effect, one problem line for each bad key or value."""
    if not isinstance(section, dict):
        problems.append(f'{OFFLOAD_KEY} must be a JSON object like {{"device": "cpu"}}, got '
                        f"{section!r}")
        return "none"
    speed_only = {key[len(OFFLOAD_KEY) + 1:]: why for key, why in SPEED_ONLY.items()
                  if key.startswith(OFFLOAD_KEY + ".")}
    for name in section:
        if name in speed_only:
            info.append(f"{OFFLOAD_KEY}.{name}: accepted, no effect here ({speed_only[name]})")
        elif name != "device":
            known = sorted(["device", *speed_only])
            problems.append(f"{OFFLOAD_KEY}.{name} is not a key of {OFFLOAD_KEY}; known keys: "
                            f"{', '.join(known)}{did_you_mean(name, known)}")
    device = section.get("device", "none")
    if device not in _DEVICES:
        problems.append(f'{OFFLOAD_KEY}.device must be "cpu", "nvme" or "none", got {device!r}')
        return "none"
    if device == "nvme":
        info.append(f"{OFFLOAD_KEY}.device nvme: the optimizer state is offloaded to host memory "
                    f"instead (NVMe offload is not implemented)")
    return "none" if device == "none" else "cpu"
