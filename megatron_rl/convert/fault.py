"""Test-only wrong mappings (``MEGATRON_RL_CONVERT_FAULT``), so tests can show ``--verify`` refuses them."""

from __future__ import annotations

import os

FAULT_ENV = "MEGATRON_RL_CONVERT_FAULT"
"""Test-only: a deliberately wrong mapping applied in the ranks (``FAULTS``), to prove --verify catches it."""
FAULTS = ("qkv_heads", "gate_up", "expert_off_by_one")


def apply_fault(weight_map, model_cfg):
    """Test-only (``FAULT_ENV``): ``weight_map`` made deliberately wrong, so tests can show that
    ``--verify`` refuses a wrong mapping. Unset: ``weight_map`` itself. ``qkv_heads`` swaps query
    heads 0 and 1 as they are read, ``gate_up`` swaps the two halves of every gated MLP,
    ``expert_off_by_one`` loads expert e+1's weights into expert e."""
    import dataclasses

    fault = os.environ.get(FAULT_ENV)
    if not fault:
        return weight_map
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r} is not allowed; choose one of {list(FAULTS)}")
    if fault == "qkv_heads":
        from parallel.bridge.hf_files import HFCheckpointReader

        head_dim, plain = weight_map.head_dim, HFCheckpointReader.read

        def read(self, name, dim=None, start=0, stop=None, *, out=None):
            if not name.endswith("self_attn.q_proj.weight") or dim not in (None, 0):
                return plain(self, name, dim, start, stop, out=out)
            full = plain(self, name).clone()
            full[:head_dim], full[head_dim : 2 * head_dim] = (
                full[head_dim : 2 * head_dim].clone(),
                full[:head_dim].clone(),
            )
            wrong = full if dim is None else full[start:stop]
            return wrong if out is None else out.copy_(wrong)

        HFCheckpointReader.read = read
        return weight_map
    if fault == "gate_up":
        rules = tuple(
            dataclasses.replace(r, hf=r.hf[::-1]) if r.transform == "gate_up" else r for r in weight_map.rules
        )
        return dataclasses.replace(weight_map, rules=rules)
    experts = model_cfg.num_moe_experts
    if not experts:
        raise ValueError(f"{FAULT_ENV}=expert_off_by_one needs an MoE model")

    class Shifted(type(weight_map.rules[0])):
        def match(self, global_name):
            m = self._regex.match(global_name)
            if m is None:
                return None
            fields = {k: int(v) for k, v in m.groupdict().items()}
            fields["expert"] = (fields["expert"] + 1) % experts
            return tuple(n.format(**fields) for n in self.hf)

    rules = tuple(Shifted(r.megatron, r.hf, r.transform, r.export) if r.is_expert else r for r in weight_map.rules)
    return dataclasses.replace(weight_map, rules=rules)
