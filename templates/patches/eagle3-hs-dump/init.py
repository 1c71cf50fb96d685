import os as _ro_os
if _ro_os.environ.get("SGLANG_HS_DUMP_DIR"):
    import remote_ops_dump
    remote_ops_dump.attach(self)
