"""Summarise Nsight Compute's per-instruction source page (a diagnosis tool for GPU visits).

On the GPU machine:

    ncu --clock-control none -k regex:cfc_ --section WarpStateStats --section SourceCounters -o cfc -f \
        python3 tools/ncu_op.py cfc
    ncu -i cfc.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz

Here (no GPU needed):

    python3 tools/ncu_sass_summary.py sass.csv.gz                 # kernels in the file
    python3 tools/ncu_sass_summary.py sass.csv.gz 0 top           # the 45 instructions with most stall samples
    python3 tools/ncu_sass_summary.py sass.csv.gz 0 regions       # samples between barriers / waits / stores
    python3 tools/ncu_sass_summary.py sass.csv.gz 0 2080:2135     # a range of instructions

For each instruction: its SASS, warp-stall samples, warp instructions executed and the top stall reasons.
"regions" cuts the listing at block barriers, mbarrier waits, remote (STAS) and global stores, MUFU and
EXIT, and prints the samples and executed instructions of each piece with its share of the kernel's samples.
"""

from __future__ import annotations

import argparse
import csv
import gzip

_CUTS = ("BAR.SYNC", "TRYWAIT", "STAS", "MUFU", "STG", "SYNCS.ARRIVE", "EXIT")


def load(path):
    """[{name, hdr, rows}] per kernel block of the CSV."""
    opener = gzip.open if path.endswith(".gz") else open
    blocks, cur = [], None
    with opener(path, "rt") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = {"name": row[1], "rows": []}
                blocks.append(cur)
            elif row[0] == "Address" and cur is not None:
                cur["hdr"] = row
            elif cur is not None:
                cur["rows"].append(row)
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("kernel", nargs="?", type=int)
    ap.add_argument("view", nargs="?", default="top")
    a = ap.parse_args()
    blocks = load(a.csv)
    if a.kernel is None:
        for i, b in enumerate(blocks):
            print(i, b["name"][:140], len(b["rows"]), "instructions")
        return
    b = blocks[a.kernel]
    ix = {k: i for i, k in enumerate(b["hdr"])}
    stalls = [k for k in b["hdr"] if k.startswith("stall_") and "Not Issued" not in k]
    rows = b["rows"]
    samples = [int(r[ix["# Samples"]]) for r in rows]
    executed = [int(r[ix["Instructions Executed"]]) for r in rows]
    total = sum(samples) or 1
    print(b["name"][:140])
    print(f"samples {sum(samples)}, warp instructions executed {sum(executed)}")
    agg = sorted(((sum(int(r[ix[s]]) for r in rows), s[6:]) for s in stalls), reverse=True)[:10]
    print("stalls:", ", ".join(f"{n} {k}" for k, n in ((k, n) for n, k in agg)))

    def reasons(r, n=3):
        return sorted(((int(r[ix[s]]), s[6:]) for s in stalls if int(r[ix[s]]) > 0), reverse=True)[:n]

    if a.view == "top":
        for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:45]):
            print(i, rows[i][1].strip()[:60].ljust(60), str(samples[i]).rjust(6), str(executed[i]).rjust(10),
                  reasons(rows[i]))
    elif a.view == "regions":
        acc = acc_i = start = 0
        for i, r in enumerate(rows):
            acc += samples[i]
            acc_i += executed[i]
            src = r[1].strip()
            if any(c in src for c in _CUTS) or samples[i] > total // 100:
                if acc > total * 0.004 or "BAR" in src or "TRYWAIT" in src:
                    print(f"{start:5d}-{i:5d} {acc:7d} ({100 * acc / total:4.1f}%) instr {acc_i:11d} | {src[:60]}")
                acc = acc_i = 0
                start = i + 1
    else:
        lo, hi = (int(v) for v in a.view.split(":"))
        for i in range(lo, min(hi, len(rows))):
            print(i, rows[i][1].strip()[:70].ljust(70), str(samples[i]).rjust(6), str(executed[i]).rjust(10),
                  reasons(rows[i], 2))


if __name__ == "__main__":
    main()
