r"""The seam: transformers' recurrence functions, routed to qedprobe for adapted layers only.

Every supported linear-attention layer's ``forward`` (transformers 5.25) projects, convolves
(``causal_conv1d_forward``, reading and writing the cache's conv state), computes ``beta`` and
its log-decay ``g``, then calls one of two functions of its modeling module, by name (the
family's rule, ``families.RULES``)::

    torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=S, output_final_state=.,
                                 use_qk_l2norm_in_kernel=True, ...)     # GDN: prompt / no cache
    torch_recurrent_gated_delta_rule(...)                              # GDN: one cached token
    chunk_kimi_delta_attention(...), recurrent_kimi_delta_attention(...)   # KDA: the same two

and finally stores the returned state in its cache and applies its gated RMSNorm and output
projection. Those two names are the only thing replaced: :func:`install` puts a
:class:`RecurrenceRoute` in their place in the modeling module. The route calls what was there
before (transformers' function: fla's kernel when fla is installed and runs on the inputs'
device, else its PyTorch code) unless the calling layer is adapted and not
:meth:`~qedprobe.hf.recurrence.LinearAttnRecurrence.runs_native` (a hook on one of its hook
points, or lambda injected), in which case it calls that layer's qedprobe recurrence.
A layer is "calling" while its ``forward`` runs: a :class:`LayerSwitch` sets it in a context
variable with a forward pre-hook and clears it with a forward hook that also runs on exceptions,
both attached only while the layer does not run natively. So models that were never adapted, in
the same process, and adapted layers with nothing hooked or injected run exactly as before, and
everything else of an adapted model (projections, conv, norm, softmax attention, MoE, cache,
``generate``) stays transformers'.

The chunk function is the **prefill** phase (a prompt, or a pass without a cache), the
recurrent one the **decode** phase (one new token continuing the cached state), as for
``qedprobe.model.strength(..., phase=...)``.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib

_ACTIVE = contextvars.ContextVar("qedprobe_hf_active_layer", default=None)


class RecurrenceRoute:
    """Stands in for one of transformers' recurrence functions (see the module docstring)."""

    def __init__(self, original, phase: str):
        self.original, self.phase = original, phase
        self.__wrapped__ = original

    def __call__(self, query, key, value, *args, **kwargs):
        layer = _ACTIVE.get()
        if layer is None or layer.runs_native():
            return self.original(query, key, value, *args, **kwargs)
        return layer.recurrence(query, key, value, *args, phase=self.phase, **kwargs)


def install(module_name: str, routed: dict[str, str]) -> None:
    """Put a :class:`RecurrenceRoute` in place of each function named in ``routed`` (``{name:
    phase}``) in the modeling module ``module_name`` (once; later calls leave it)."""
    mod = importlib.import_module(module_name)
    for name, phase in routed.items():
        fn = getattr(mod, name)
        if not isinstance(fn, RecurrenceRoute):
            setattr(mod, name, RecurrenceRoute(fn, phase))


class LayerSwitch:
    """Makes ``recurrence`` the active layer while ``module`` (a transformers linear-attention layer)
    runs its forward, with a forward pre-hook that sets the context variable and a forward hook
    (run on exceptions too) that resets it. Those two module hooks are attached only while the
    recurrence does not run natively: an adapted layer with nothing hooked and nothing injected
    carries none, so its forward is the same call as in a model that was never adapted.

    :meth:`sync` re-decides after every change of the hooks or the injection (the recurrence calls
    it). A change while the layer's forward runs takes effect when it ends: a hook removed from
    inside that forward leaves both module hooks in place until the forward hook has reset the
    context variable, then detaches them; one added there attaches them for the next forward.
    """

    def __init__(self, module, recurrence):
        self.module, self.recurrence = module, recurrence
        self.handles, self.tokens = [], []
        self.sync()

    def sync(self) -> None:
        """Attach the module hooks if the recurrence does not run natively; detach them if it does
        and its layer's forward is not running (else the forward hook detaches them at its end)."""
        if not self.recurrence.runs_native():
            if not self.handles:
                self.handles = [self.module.register_forward_pre_hook(self.enter),
                                self.module.register_forward_hook(self.leave, always_call=True)]
        elif not self.tokens:
            self.remove()

    def enter(self, module, args) -> None:
        self.tokens.append(_ACTIVE.set(self.recurrence))

    def leave(self, module, args, out) -> None:
        if self.tokens:  # empty when the hooks were attached while this forward ran
            _ACTIVE.reset(self.tokens.pop())
        self.sync()  # what changed while the forward ran

    def remove(self) -> None:
        """Detach the module hooks (the layer runs as transformers wrote it)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def torch_function(fn):
    """transformers' own PyTorch implementation behind ``fn`` (a route, or transformers'
    wrapper that picks fla's kernel when fla is installed): the innermost ``__wrapped__``."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@contextlib.contextmanager
def transformers_torch_path(model_type: str):
    """Inside the block, every layer of ``model_type``'s modeling module that runs the model's
    own function (not adapted, or adapted and running natively) runs transformers' PyTorch
    recurrence as written in transformers, even when fla is installed: the reference that an
    adapted model is compared with."""
    from .families import modeling_module_name, routed_functions
    module_name, routed = modeling_module_name(model_type), routed_functions(model_type)
    install(module_name, routed)
    mod = importlib.import_module(module_name)
    routes = [getattr(mod, name) for name in routed]
    try:
        for route in routes:
            route.original = torch_function(route.__wrapped__)
        yield
    finally:
        for route in routes:
            route.original = route.__wrapped__
