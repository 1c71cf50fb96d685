"""Host probes: one unit per question asked of a host, its command beside its parser.

Each module is one domain; each class in it is one probe (`base.Probe`): what
it runs on the host (`command()`), how its output reads back (`parse`, pure),
and beside it, where it has one, its ok / warn / fail evaluator (`check_*`,
returning `base.Check`).  `batch` asks several probes in one SSH round trip and
hands each its own answer.  Workflows pick the probes, run one round trip,
evaluate, and return result objects.

    base.py       Probe, Check, Output / Sections
    batch.py      several probes in one round trip; the per-probe deadline on the host
    system.py     OS, kernel, CPUs, memory (facts); python3 for the on-host tools (preflight)
    gpu.py        nvidia-smi's GPUs and compute processes; count / ECC / temperature / fusion checks
    gpuhealth.py  nvidia-smi's SRE fields: PCIe link, memory rows, throttle, persistence, driver vs CUDA
    kernlog.py    NVIDIA Xid events in the kernel log since the container started
    engine.py     the engine's version, container + image, runtimes (built and read by engine/)
    patch.py      the patched file inside the running container
    endpoints.py  SGLang's HTTP endpoints (curl, or python3's urllib)
    disk.py       free space where the dumps go
    sglang.py     the SGLang tree: its release, the patch target's sha256
    dumps.py      the dump dir: status listing, host-side verify, growth (health)
    audit.py      the dump audit in a throwaway container of the served image; the dumps' recorded contract
    throughput.py SGLang's scheduler lines from the container's log, every rank's stats.json (server figures, dumper cost)
    extract.py    the extraction client (and dataset regenerate's, same layout): alive, status, done keys
    logs.py       a log file's new bytes after a cursor
    lock.py       the host lock: read, take, its `info`

Nothing is imported here: a command imports only the probes it asks.
"""
