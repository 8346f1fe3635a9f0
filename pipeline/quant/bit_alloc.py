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
  bits: the 8-bit grid's weight error is ~50x below 4 bits' (tests)). The
  error is the logits' exactly, computed from the final hidden states through
  the head's Gram matrices (HeadError: no 262k-vocab logits), and a unit of
  layer l reruns only layers l and up (the ones below replayed from the
  all-at-codes run): the same gains as the direct logits (to ~1e-6 relative,
  tests) at a fraction of the cost;
- the *cost* is the unit's extra bytes at 8 bits (K*N/2 a linear): decode
  streams every weight once a token, so bytes are its time;
- units are taken in order of gain per byte while the extra bytes fit the
  budget (a fraction of the decoder linears' 4-bit code bytes).

Measured exactly, a unit of layer l costs the layers from l up: on average
half a model run per unit, 4 units a layer, so about 2L runs for L layers
(the 1.75B geometry: 112 units, ~58 runs of the model). Where that is more
than EXACT_MAX_RUNS runs, the gains are the first-order ones instead
(`first_order_gains`): the logits' error L is differentiated once with
respect to every linear's output, at the all-at-codes point, and putting
unit u back lowers L by about <dL/dW_u, W_u - W_u,fp> = sum(g_y * (x E_u^T))
(y = x W^T, E_u its codes' error): one forward and one backward run for every
unit at once, whatever the model's depth. It is the exact gain's leading term
(for a linear map of the weights the gain is 2<JE, JE_u> - |JE_u|^2 and this
is 2<JE, JE_u>); where the units' errors are uncorrelated, <JE, JE_u> =
|JE_u|^2 and the gain is half of it, which is what is recorded as the gain.
It ranks the units the same in that case; its agreement with the exact gains on the small models is in
docs/eight-bit-units.md. The final choice's SNR is always measured exactly.

Written by hand: this is a few lines of greedy selection around forward
passes; the packages that do mixed precision (llama.cpp's quantize, ORT's
quantizer) fix the policy per tensor name rather than measuring it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The exact measure's cost, in runs of the whole model, above which the first-order gains are used
# (sensitivity: auto): the embedded model's 2-4 layers stay exact; Gemma 3 270M (72 units, ~38 runs)
# and deeper models take the first-order gains.
EXACT_MAX_RUNS = 8
SENSITIVITIES = ("auto", "exact", "first_order")


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
    sum((z - z_ref)^2) / sum(z_ref^2), the quantity the parity stage reports as SNR (-10 log10).

    The direct way: every window's [tokens, vocab] logits, held for the reference. measure() uses it only
    where HeadError's shortcut does not apply (a head that is not one bias-free linear of the decoder's
    final hidden state); it is also the yardstick HeadError is tested against."""

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

    def __call__(self, changed=None) -> float:
        import torch

        return float(((self._logits() - self.ref) ** 2).sum(dtype=torch.float64)) / self.norm


class HeadError:
    """The same relative squared error of the logits, without making a logit.

    The logits are z = A h (A: the head at its codes, [V, d]; h: the decoder's final hidden state, after the
    final norm), the reference's z_ref = B m (B: the full-precision head, m: the full-precision model's h).
    With d = h - m and E = A - B:

        |z - z_ref|^2 = |A d + E m|^2 = d^T (A^T A) d + 2 d^T (A^T E) m + m^T (E^T E) m
        |z_ref|^2     = m^T (B^T B) m

    so four d x d Gram matrices of the head (made once, in row chunks) give the error of every token
    exactly, at d^2 a token instead of V*d (Gemma 3 270M: 640^2 against 262144*640; written in d and E,
    not A h - B m, so that no two large terms cancel). What it saves: on Gemma 3 270M one run of the model
    over 4 x 528 tokens spent ~2.6 of its ~3.8 s making the 262k-vocab logits and held 2.2 GB of them
    for the reference alone.

    `reuse_prefix`: putting unit u (of layer l) back changes nothing below layer l, so the decoder layers
    below l are replayed from the outputs the all-at-codes run cached (`capture`) instead of being run
    again: a unit costs the layers from its own up (on average half the model). Checked once against a
    full run (`check_replay`); where the model's loop does not take the replay, every run is a full one.
    """

    def __init__(self, model, windows, decoder, head, layers):
        import torch

        self.model, self.decoder, self.head, self.layers = model, decoder, head, layers
        self.windows = torch.as_tensor(windows, dtype=torch.long)
        self.cache: list[list] | None = None  # per window, per layer: the all-at-codes run's output
        self.reuse_prefix = layers is not None
        self.ref = [h.double() for h in self._hidden()]  # m, the model still at full precision
        self.grams = None

    @classmethod
    def of(cls, model, windows):
        """A HeadError for `model`, or None where its logits are not head(final hidden state) (checked on
        a few tokens against the model's own logits)."""
        import torch

        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        decoder = getattr(model, "base_model", None)
        if not isinstance(head, torch.nn.Linear) or head.bias is not None or decoder is None or decoder is model:
            return None
        config = getattr(model, "config", None)
        config = getattr(config, "text_config", None) or config
        if getattr(config, "final_logit_softcapping", None):  # tanh of the logits (Gemma 2): not linear
            return None
        ids = torch.as_tensor(windows[0][:16], dtype=torch.long)[None]
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0].double()
            hidden = decoder(ids, use_cache=False).last_hidden_state[0].double()
        if not torch.allclose(hidden @ head.weight.double().T, logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max())):
            return None  # a softcap, a scale, a bias: the logits are not the head's linear map
        layers = getattr(decoder, "layers", None)
        return cls(model, windows, decoder, head, layers if isinstance(layers, torch.nn.ModuleList) else None)

    def set_head(self, codes) -> None:
        """Fix the head at its codes (A = `codes`; the model's head still holds B) and make the Grams."""
        import torch

        b_all = self.head.weight.data
        d = b_all.shape[1]
        g = {k: torch.zeros(d, d, dtype=torch.float64) for k in ("aa", "ae", "ee", "bb")}
        for r in range(0, b_all.shape[0], 16384):  # fp32 products of 16k rows, summed in fp64
            a, b = codes[r : r + 16384].float(), b_all[r : r + 16384]
            e = a - b
            g["aa"] += (a.T @ a).double()
            g["ae"] += (a.T @ e).double()
            g["ee"] += (e.T @ e).double()
            g["bb"] += (b.T @ b).double()
        self.head.weight.data.copy_(codes)
        self.window_norms = [float(((m @ g["bb"]) * m).sum()) for m in self.ref]
        self.norm = sum(self.window_norms)
        self.window_consts = [float(((m @ g["ee"]) * m).sum()) for m in self.ref]
        self.cross = [m @ g["ae"].T for m in self.ref]  # (A^T E) m, a row per token
        self.gram = g["aa"]

    def _hidden(self, start: int = 0, capture: bool = False):
        """The final hidden state of every window, layers below `start` replayed from the cache."""
        import torch

        out, handles, saved = [], [], {}
        cache = [[] for _ in self.windows] if capture else None
        try:
            if capture:
                for i, layer in enumerate(self.layers):
                    handles.append(layer.register_forward_hook(
                        lambda _m, _a, o, i=i: cache[self._w].append(o[0] if isinstance(o, tuple) else o)))
            for self._w, w in enumerate(self.windows):
                if start:
                    for i in range(start):
                        saved.setdefault(i, self.layers[i])
                        self.layers[i] = _replay(saved[i], self.cache[self._w][i])
                with torch.no_grad():
                    out.append(self.decoder(w[None], use_cache=False).last_hidden_state[0])
        finally:
            for i, layer in saved.items():
                self.layers[i] = layer
            for h in handles:
                h.remove()
        if capture:
            self.cache = cache
        return out

    def final_hidden(self) -> list:
        """The decoder's final hidden state of every window ([T, d] each) with the model as it is now: a
        full run (pipeline/quant/head_rows.py measures the head's rows on them)."""
        return self._hidden()

    def loss(self, w: int, hidden):
        """Window `w`'s |z - z_ref|^2 / |z_ref|^2 (over every window's norm) as a differentiable tensor of
        its final hidden state `hidden` [T, d]."""
        dlt = hidden.double() - self.ref[w]
        return (self.window_consts[w] + ((dlt @ self.gram) * dlt).sum() + 2 * (dlt * self.cross[w]).sum()) / self.norm

    def exact_runs(self, units_) -> float:
        """The exact measure's cost in runs of the whole model: a unit of layer l reruns layers l and up."""
        if not self.reuse_prefix or not self.layers:
            return float(len(units_))
        n = len(self.layers)
        return sum(n - min(self.layer_of(name) for name in u.layers) for u in units_) / n

    def _error(self, hidden) -> float:
        self.per_window = []  # each window's |z - z_ref|^2 (its own relative error: / window_norms)
        for h, m, cross, const in zip(hidden, self.ref, self.cross, self.window_consts):
            dlt = h.double() - m
            self.per_window.append(const + float(((dlt @ self.gram) * dlt).sum()) + 2 * float((dlt * cross).sum()))
        return max(sum(self.per_window), 0.0) / self.norm

    def base(self) -> float:
        """The error with the model as it is now (every linear at its codes); caches every layer's output."""
        self._base_hidden = self._last = self._hidden(capture=self.reuse_prefix)
        return self._error(self._base_hidden)

    def head_errors(self, options: dict, full, embedding=None) -> dict:
        """The error with the decoder as in the last run and the head at each of `options` ({key: a
        callable making its dequantized codes}) in turn; `full()`: the head's full-precision weight. The
        decoder's final hidden states do not depend on the head, so no model runs: per option the head's
        Grams only. `embedding`: the input embedding module where it is to be the head's own tensor (a
        tied checkpoint shipping one table): it takes each option's codes too, and each option is then
        a full run of the decoder. Each weight is made when needed and dropped once copied in (on Gemma 3
        270M each is 671 MB). Leaves the head (and `embedding`) at the last option's codes."""
        out = {}
        for key, make in options.items():
            w = full()
            self.head.weight.data.copy_(w)
            del w
            codes = make()
            self.set_head(codes)
            if embedding is not None:
                embedding.weight.data.copy_(codes)
            del codes
            out[key] = self._error(self._hidden() if embedding is not None else self._last)
        return out

    def check_replay(self) -> None:
        """Replay the lower half, run the rest: the final hidden states must be the cached run's; if they
        are not, stop replaying (every unit then costs a full run). Call right after base()."""
        import torch

        if not self.reuse_prefix or len(self.layers) < 2:
            self.reuse_prefix = False
            return
        full = self._base_hidden
        try:
            half = self._hidden(start=len(self.layers) // 2)
            ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(full, half))
        except Exception:  # noqa: BLE001 - a decoder loop that passes or expects something the replay lacks
            ok = False
        self.reuse_prefix = ok

    def layer_of(self, name: str) -> int:
        """The decoder layer a linear belongs to (0 where it is not found: a full run)."""
        if self.layers is not None:
            for i, layer in enumerate(self.layers):
                if any(m is layer for _, m in _parents(self.model, name)):
                    return i
        return 0

    def __call__(self, changed=None) -> float:
        """The error with the model as it is now; `changed`: the linears changed since the base run
        (the layers below all of them are replayed), None for a full run."""
        start = min((self.layer_of(n) for n in changed), default=0) if changed and self.reuse_prefix else 0
        self._last = self._hidden(start=start)
        return self._error(self._last)


def _parents(model, name: str):
    parts = name.split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k])
        yield prefix, model.get_submodule(prefix)


def _checkpointed(real):
    """Decoder layer `real` run under torch.utils.checkpoint (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    from pipeline.quant.layerwise import stand_in

    return stand_in(real, lambda *args, **kwargs: checkpoint(real, *args, use_reentrant=False, **kwargs))


def _replay(real, output):
    """A module standing in for decoder layer `real` that returns `output` (the cached run's, in the same
    form: a tensor or a tuple)."""
    from pipeline.quant.layerwise import stand_in

    return stand_in(real, lambda *args, **kwargs: output)


def first_order_gains(model, err: HeadError, units_: list[Unit], full, on_unit=None) -> dict[str, float]:
    """Every unit's first-order gain (module docstring) from one forward and one backward run per window,
    the model at its codes: half of sum over the unit's linears of sum(g_y * (x (W - W_fp)^T)), g_y the
    loss's gradient at the linear's output y = x W^T. No weight gradient is made (the weights are frozen
    and the graph starts at the embedding's output), so no second copy of the model is held."""
    import torch

    unit_of = {name: u.key for u in units_ for name in u.layers}
    mods = {name: model.get_submodule(name) for name in unit_of}
    gains = {u.key: 0.0 for u in units_}
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    seen: set[str] = set()  # the linears hooked in this window's forward (a checkpointed layer runs twice)

    def hook(name):
        def on_forward(mod, args, out):
            if name in seen or not out.requires_grad:  # the backward's recomputation of a checkpointed layer
                return
            seen.add(name)
            x = args[0].detach()

            def on_grad(g):
                e = mod.weight.detach() - full(name)
                # half the first-order term: the gain itself where the units' errors are uncorrelated
                gains[unit_of[name]] += 0.5 * float((g.double() * (x @ e.T).double()).sum())

            out.register_hook(on_grad)
        return on_forward

    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    handles.append(err.decoder.get_input_embeddings().register_forward_hook(
        lambda _m, _a, out: out.detach().requires_grad_()))
    # Each decoder layer checkpointed (torch.utils.checkpoint): the backward recomputes a layer's
    # activations from its input instead of holding every layer's (~4 GB for one 528-token window at 1.75B).
    layers = err.layers if err.layers is not None else []
    real = list(layers)
    try:
        for i, layer in enumerate(real):
            layers[i] = _checkpointed(layer)
        for w, ids in enumerate(err.windows):
            seen.clear()
            with torch.enable_grad():
                hidden = err.decoder(ids[None], use_cache=False).last_hidden_state[0]
                err.loss(w, hidden).backward()
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(True)
    if on_unit is not None:
        for u in units_:
            on_unit(u)
    return gains


def measure(model, windows, units_: list[Unit], names: list[str], at_codes, full, on_unit=None,
            exact_logits: bool = False, sensitivity: str = "exact") -> dict:
    """Each unit's gain. `names`: every linear to hold at its codes (the head included, at its own
    width); `at_codes(name)` / `full(name)`: that linear's dequantized / full-precision weight (made on
    demand, so no second copy of the model is held). Leaves the model's linears at their codes.
    Returns {"base": the error with every linear at its codes, "gains": {unit key: base - the error
    with that unit at full precision}, "error": the error measure, to measure a final choice with
    (error(changed=[names]): the linears changed since), "method": how it was measured}.

    The error is HeadError's (exact, from the final hidden states and the head's Grams, the layers below
    a unit replayed) where the model allows it; else, or with `exact_logits`, LogitsError's (every
    window's logits, every unit a full run). `sensitivity`: "exact" puts each unit back in turn;
    "first_order" takes first_order_gains (HeadError's error only); "auto" the first where it costs at most
    EXACT_MAX_RUNS runs of the model. The record says which ("method", "exact_runs")."""
    if sensitivity not in SENSITIVITIES:
        raise ValueError(f"sensitivity must be one of {SENSITIVITIES}, got {sensitivity!r}")
    err = None if exact_logits else HeadError.of(model, windows)
    params = {name: model.get_submodule(name).weight for name in names}
    if err is None:
        err = LogitsError(model, windows)  # the model still holds the checkpoint's weights here
        for name in names:
            params[name].data.copy_(at_codes(name))
        base, method = err(), "logits"
    else:
        head = next((n for n in names if params[n] is err.head.weight), None)
        err.set_head(at_codes(head) if head is not None else err.head.weight.data.clone())
        for name in names:
            if name != head:
                params[name].data.copy_(at_codes(name))
        base = err.base()
        err.check_replay()
        method = "head_gram" + ("+prefix_replay" if err.reuse_prefix else "")
    # each window's squared logits error (and its reference's squared norm), for the spread between windows
    per_window = {"norms": getattr(err, "window_norms", None), "base": getattr(err, "per_window", None), "units": {}}
    runs = err.exact_runs(units_) if isinstance(err, HeadError) else float(len(units_))
    if isinstance(err, HeadError) and (sensitivity == "first_order"
                                       or (sensitivity == "auto" and runs > EXACT_MAX_RUNS)):
        gains = first_order_gains(model, err, units_, full, on_unit)
        return {"base": base, "gains": gains, "error": err, "method": "first_order+head_gram",
                "exact_runs": round(runs, 2), "per_window": per_window}
    gains = {}
    for u in units_:
        for name in u.layers:
            params[name].data.copy_(full(name))
        gains[u.key] = base - err(changed=u.layers)
        per_window["units"][u.key] = getattr(err, "per_window", None)
        for name in u.layers:
            params[name].data.copy_(at_codes(name))
        if on_unit is not None:
            on_unit(u)
    return {"base": base, "gains": gains, "error": err, "method": method, "exact_runs": round(runs, 2),
            "per_window": per_window}

