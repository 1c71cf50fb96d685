"""The labels remote-ops puts on images and containers: their one definition.

The Dockerfile's labels (`deploy.context.dockerfile_variables`), the plan's
checks (`deploy.plan`), `health` and the run spec (`engine.spec.for_host`)
all use these names.
"""

from __future__ import annotations

LABEL_PREFIX = "org.remote-ops."

# image labels (set by the Dockerfile template at build time)
PATCH_ID = LABEL_PREFIX + "patch.id"
PATCH_HASH = LABEL_PREFIX + "patch.hash"
SHA_BEFORE = LABEL_PREFIX + "source.sha256.before"
SHA_AFTER = LABEL_PREFIX + "source.sha256.after"
TOOL_VERSION = LABEL_PREFIX + "version"
SGLANG_VERSION = LABEL_PREFIX + "sglang.version"
BASE_IMAGE = LABEL_PREFIX + "base-image"
CONTEXT_HASH = LABEL_PREFIX + "context-hash"  # hash of every build input

# container labels (set at create time)
MANAGED = LABEL_PREFIX + "managed"
HOST = LABEL_PREFIX + "host"
RUN_CONFIG = LABEL_PREFIX + "run-config"  # hash of the run spec: a changed setting means a restart
# `device:inode` of the host's dump dir when the container was created: host state, not a setting,
# so not in the run-config hash; a dir removed and made again since reads as a stale mount
DUMP_DIR_ID = LABEL_PREFIX + "dump-dir.id"

#: Container labels that are not run settings: left out of the run-config hash.
NOT_SETTINGS = frozenset({RUN_CONFIG, DUMP_DIR_ID})
