"""What verifying checkpoints costs: writes SIZE_MB of checkpoint-like files (4 shards of random bytes)
and times the manifest at save (size + CRC-32 of every file) and the verification at resume.

    python experiments/reliability/checksum_cost.py [SIZE_MB]
"""

import os
import sys
import tempfile
import time
from pathlib import Path

from trillion.trainer.checkpoint.verify import damaged_files, write_manifest


def main(size_mb: int = 512) -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for shard in range(4):
            (root / f"__{shard}_0.distcp").write_bytes(os.urandom(size_mb * (1 << 20) // 4))
        (root / ".metadata").write_bytes(os.urandom(1 << 16))
        start = time.perf_counter()
        write_manifest(root)
        saved = time.perf_counter() - start
        start = time.perf_counter()
        assert damaged_files(root) == []
        verified = time.perf_counter() - start
    print(
        f"{size_mb} MB: manifest at save {saved:.2f} s ({size_mb / saved:.0f} MB/s), "
        f"verification at resume {verified:.2f} s ({size_mb / verified:.0f} MB/s) on one process "
        f"(files in the page cache; at scale each rank verifies 1/world of the files)"
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
