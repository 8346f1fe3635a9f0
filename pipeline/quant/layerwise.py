"""A Hugging Face decoder run one layer at a time over many batches.

The whole-model forward runs every layer on one batch before the next batch:
whatever is gathered per layer (calibration's second moments: 454 MB of
float64 a layer on the 1.75B geometry, 12.7 GB for 28 layers) is held for
every layer at once. Run the other way round, layer i over every batch before
layer i + 1, only one layer's is held, and a layer's weights can be dropped
as soon as it is done. This is the layer-sequential order of GPTQ's reference
code and of llm-compressor's sequential pipeline; written here because both
tie it to their own quantizers.

How: the decoder's own loop is run once per batch with every layer replaced by
a stand-in that records the arguments the loop gives it (the attention mask
and rotary tables of the layer's type, the position ids) and passes the
hidden state through; then each real layer is called with its recorded
arguments. `check` compares this with the decoder's own forward on a short
prefix, bit for bit, before any long work, so a family whose loop does
something else between layers fails fast instead of calibrating on the wrong
activations.
"""

from __future__ import annotations


class LayerwiseError(RuntimeError):
    pass


_STANDIN = []


def stand_in(real, forward):
    """A module taking decoder layer `real`'s place in its ModuleList: calling it calls `forward(*args,
    **kwargs)`, and the real layer's attributes (its attention type, its index) stay readable by the
    decoder's loop. Used to record a layer's arguments (capture), to replay a cached output, and to run
    a layer under activation checkpointing (pipeline/quant/bit_alloc.py)."""
    if not _STANDIN:
        import torch

        class StandIn(torch.nn.Module):
            def __init__(self, real, forward):
                super().__init__()
                object.__setattr__(self, "_real", real)
                object.__setattr__(self, "_forward", forward)

            def __getattr__(self, key):
                try:
                    return super().__getattr__(key)
                except AttributeError:
                    return getattr(object.__getattribute__(self, "_real"), key)

            def forward(self, *args, **kwargs):
                return self._forward(*args, **kwargs)

        _STANDIN.append(StandIn)
    return _STANDIN[0](real, forward)


def layers_of(decoder):
    import torch

    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise LayerwiseError("the decoder has no `layers` ModuleList to run one layer at a time")
    if not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        raise LayerwiseError("the decoder has no final `norm` module")
    return layers


def capture(decoder, ids):
    """(the hidden state the decoder's loop gives its first layer for `ids` [B, T], per decoder layer the
    (args, kwargs) its loop passes it)."""
    import torch

    layers = layers_of(decoder)
    calls: list = []
    first: list = []

    def record(hidden, *args, **kwargs):
        if not calls:
            first.append(hidden)
        calls.append((args, kwargs))
        return hidden

    real = list(layers)
    try:
        for i, layer in enumerate(real):
            layers[i] = stand_in(layer, record)
        with torch.no_grad():
            decoder(input_ids=ids, use_cache=False)
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    if len(calls) != len(real):
        raise LayerwiseError(f"the decoder's loop called {len(calls)} of {len(real)} layers")
    # The first layer's input as the loop hands it over, not the embedding module's output: Granite
    # multiplies the embedding by embedding_multiplier in GraniteModel.forward, between the two (Gemma
    # scales inside the module); a family that transforms the hidden state between layers fails check()
    return first[0], calls


def step(layer, hidden, call):
    """One decoder layer on `hidden` with its recorded (args, kwargs)."""
    args, kwargs = call
    out = layer(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def check(decoder, ids) -> None:
    """The layer-by-layer run must give the decoder's own final hidden state for `ids`, exactly."""
    import torch

    with torch.no_grad():
        ref = decoder(input_ids=ids, use_cache=False).last_hidden_state
        hidden, calls = capture(decoder, ids)
        for layer, call in zip(layers_of(decoder), calls):
            hidden = step(layer, hidden, call)
        hidden = decoder.norm(hidden)
    if hidden.shape != ref.shape or not torch.equal(hidden, ref):
        diff = float((hidden - ref).abs().max()) if hidden.shape == ref.shape else float("nan")
        raise LayerwiseError(f"running the decoder one layer at a time does not reproduce its forward "
                             f"(max difference {diff:.3g} on {ids.shape[1]} tokens): this family's loop "
                             f"does more between layers than it records")
