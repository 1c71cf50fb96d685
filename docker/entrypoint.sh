#!/bin/sh
# remote-ops image entrypoint: say what is running, make the dump dir, become the server.
# The server command (SGLang's launcher + its arguments) is the container's CMD/args.
set -e
echo "remote-ops entrypoint: $(date -u +%Y-%m-%dT%H:%M:%SZ) starting: $*"
if [ -n "${SGLANG_HS_DUMP_DIR:-}" ]; then
    mkdir -p "$SGLANG_HS_DUMP_DIR"
    echo "remote-ops entrypoint: hidden-state dumps on -> $SGLANG_HS_DUMP_DIR (layers ${SGLANG_HS_DUMP_LAYERS:-default})"
fi
exec "$@"
