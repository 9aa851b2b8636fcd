"""A progress report for loading or converting a big model."""

from __future__ import annotations

import sys
import time

# Models under this many bytes load without a report.
MIN_BYTES = 256 << 20


class Progress:
    """Tensors and bytes done while loading or converting a big model: a tqdm bar on a terminal,
    else one summary line on stderr at the end; nothing for models under MIN_BYTES."""

    def __init__(self, what: str, total_bytes: int, n_tensors: int, enabled: bool):
        self.what, self.total, self.n = what, total_bytes, n_tensors
        self.done_tensors = 0
        self.enabled = enabled and total_bytes >= MIN_BYTES
        self.bar = None
        self.start = time.perf_counter()
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                desc=what,
                file=sys.stderr,
                leave=False,
                postfix=f"0/{n_tensors} tensors",
            )

    def update(self, nbytes: int) -> None:
        self.done_tensors += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.done_tensors}/{self.n} tensors", refresh=False)
            self.bar.update(nbytes)

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled and ok:
            s = time.perf_counter() - self.start
            print(
                f"{self.what}: {self.done_tensors} tensors, {self.total / 1e9:.2f} GB in {s:.1f} s "
                f"({self.total / 1e9 / max(s, 1e-9):.2f} GB/s)",
                file=sys.stderr,
                flush=True,
            )
