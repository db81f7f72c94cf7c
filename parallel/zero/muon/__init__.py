"""Muon: orthogonalised momentum (Newton-Schulz) as an update rule of the ZeRO optimizer."""
from gigatron.parallel.zero.muon.config import MuonConfig
from gigatron.parallel.zero.muon.newton_schulz import newton_schulz, scale_factor
from gigatron.parallel.zero.muon.optimizer import Muon

__all__ = ["MuonConfig", "Muon", "newton_schulz", "scale_factor"]
