"""The pure core: decisions on text and values.

Nothing here holds a `Remote`, starts a process or opens a socket; modules take
text/values (file bytes, probe output, inventory YAML) and return values, so
they are unit-tested from captured text.  Builders of remote commands live here
(`shell`); running them is the workflows' job (`remote_ops.workflows`).
`anchors` is also shipped to hosts and run there with plain `python3`.
"""
