"""The in-container hidden-state dumper (copied into the SGLang image as `remote_ops_dump`).

Only relative imports, the stdlib and torch are allowed here: the package runs
inside SGLang's image under another name.  torch is imported lazily so that
`dumpfile` (stdlib only) stays importable where torch is absent.

Entry points called by the patch blocks in `DeepseekV2ForCausalLM`:
- `attach(model)` from `__init__` (turns capture on, stores `model._remote_ops_dump`);
- `model._remote_ops_dump.capture(forward_batch, hidden_states, aux_hidden_states)`
  from `forward`.
"""

from __future__ import annotations


def attach(model, **overrides):
    """Wire the dumper into a DeepseekV2ForCausalLM-shaped model; see `attach.attach`."""
    from .attach import attach as _attach

    return _attach(model, **overrides)


__all__ = ["attach"]
