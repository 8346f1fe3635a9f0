"""Which decoder linears get 8 bits instead of 4: chosen by measurement.

4-bit error does not hurt every linear alike. On the ~100M Qwen3-shaped model
(random weights, README) the logits lost 7.6 dB to 4-bit GPTQ; rounding
layer 0's attention (q, k, v, o: 3% of the weights) at 8 bits instead gave
10.2 dB, every other single layer at 8 bits 7.7-8.3. llama.cpp's Q4_K_M
encodes a fixed guess of the same effect (Q6_K for attn_v and ffn_down in the
first and last eighth of the layers and every third between). Here the
choice is measured on the model itself, so it follows wherever the model
is sensitive:

- a *unit* is the set of linears that read the same input (the calibration
  stage's shared second moment: q/k/v, gate/up). The decode graph fuses a
  unit into one kernel call, which takes one width, so a unit is promoted
  whole;
- the unit's *gain* is how much of the logits' error goes away when that unit
  alone is put back at full precision, everything else at its 4-bit codes,
  measured on held-out calibration windows (full precision stands in for 8
  bits: the 8-bit grid's weight error is ~50x below 4 bits' (tests));
- the *cost* is the unit's extra bytes at 8 bits (K*N/2 a linear): decode
  streams every weight once a token, so bytes are its time;
- units are taken in order of gain per byte while the extra bytes fit the
  budget (a fraction of the decoder linears' 4-bit code bytes).

Written by hand: this is a few lines of greedy selection around forward
passes; the packages that do mixed precision (llama.cpp's quantize, ORT's
quantizer) fix the policy per tensor name rather than measuring it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Unit:
    key: str  # its linears' common prefix and their own names: model.layers.0.self_attn.q_proj+k_proj+v_proj
    layers: list[str]
    extra_bytes: int  # bytes added by 8-bit codes over 4-bit ones


def _label(names: list[str]) -> str:
    prefix = names[0].rsplit(".", 1)[0]
    if len(names) == 1 or any(n.rsplit(".", 1)[0] != prefix for n in names):
        return "+".join(names)
    return f"{prefix}." + "+".join(n.rsplit(".", 1)[1] for n in names)


def units(calibrated: dict[str, dict], exclude: tuple[str, ...] = ()) -> list[Unit]:
    """The promotable units of calibration.json's `layers`, in their order; `exclude`: linears left out
    (the head, whose width is its own setting)."""
    grouped: dict[str, list[str]] = {}
    for name, info in calibrated.items():
        if name not in exclude:
            grouped.setdefault(str(info.get("hessian", name)), []).append(name)
    return [Unit(_label(names), names, code_bytes({n: calibrated[n] for n in names})) for names in grouped.values()]


def code_bytes(calibrated: dict[str, dict], exclude: tuple[str, ...] = ()) -> int:
    """The 4-bit code bytes of every linear but `exclude` (K*N/2 each): what the budget is a fraction of."""
    return sum(int(i["in_features"]) * int(i["out_features"]) // 2 for n, i in calibrated.items() if n not in exclude)


def choose(gains: dict[str, float], units_: list[Unit], budget_bytes: float) -> list[str]:
    """Greedy by gain per extra byte, skipping a unit that no longer fits; a unit with no gain
    (measurement noise or a zero-error layer) is never taken."""
    order = sorted((u for u in units_ if gains.get(u.key, 0.0) > 0),
                   key=lambda u: gains[u.key] / max(u.extra_bytes, 1), reverse=True)
    chosen, spent = [], 0
    for u in order:
        if spent + u.extra_bytes <= budget_bytes:
            chosen.append(u.key)
            spent += u.extra_bytes
    return chosen


class LogitsError:
    """Relative squared error of a model's logits against its full-precision ones on fixed windows:
    sum((z - z_ref)^2) / sum(z_ref^2), the quantity the parity stage reports as SNR (-10 log10)."""

    def __init__(self, model, windows):
        import torch

        self.model = model
        self.windows = torch.as_tensor(windows, dtype=torch.long)
        self.ref = self._logits()
        self.norm = float((self.ref**2).sum(dtype=torch.float64))

    def _logits(self):
        import torch

        with torch.no_grad():
            return torch.cat([self.model(w[None]).logits[0].float() for w in self.windows])

    def __call__(self) -> float:
        import torch

        return float(((self._logits() - self.ref) ** 2).sum(dtype=torch.float64)) / self.norm


def measure(model, windows, units_: list[Unit], names: list[str], at_codes, full, on_unit=None) -> dict:
    """Each unit's gain. `names`: every linear to hold at its codes (the head included, at its own
    width); `at_codes(name)` / `full(name)`: that linear's dequantized / full-precision weight (made on
    demand, so no second copy of the model is held). Leaves the model's linears at their codes.
    Returns {"base": the error with every linear at its codes, "gains": {unit key: base - the error
    with that unit at full precision}, "error": the LogitsError, to measure a final choice with}."""
    err = LogitsError(model, windows)  # the model still holds the checkpoint's weights here
    params = {name: model.get_submodule(name).weight for name in names}
    for name in names:
        params[name].data.copy_(at_codes(name))
    base = err()
    gains = {}
    for u in units_:
        for name in u.layers:
            params[name].data.copy_(full(name))
        gains[u.key] = base - err()
        for name in u.layers:
            params[name].data.copy_(at_codes(name))
        if on_unit is not None:
            on_unit(u)
    return {"base": base, "gains": gains, "error": err}
