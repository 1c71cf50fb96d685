if getattr(self, "_remote_ops_dump", None) is not None:
    self._remote_ops_dump.capture(forward_batch, hidden_states, aux_hidden_states)
