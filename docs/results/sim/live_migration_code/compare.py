import json
import glob
import os
import statistics as st
metrics = [("TTFT mean", lambda r: r["ttft_ms"]["mean"]), ("TTFT p99", lambda r: r["ttft_ms"]["p99"]),
           ("decode p99", lambda r: r["decode_ms"]["p99"]), ("e2e mean", lambda r: r["e2e_ms"]["mean"]),
           ("e2e p99", lambda r: r["e2e_ms"]["p99"]), ("preempt loss mean", lambda r: r["preemption_loss_ms_mean"]),
           ("migrations", lambda r: r["migrations"])]
rows, inside, total = [], 0, 0
for f in sorted(glob.glob("docs/results/sim/live_migration_code/before/*.json")):
    name = os.path.basename(f)
    a = json.load(open(f))["per_seed"]
    g = f.replace("before", "after")
    if not os.path.exists(g):
        continue
    b = json.load(open(g))["per_seed"]
    cell = json.load(open(f))["workload"]
    for pol in a:
        for m, fn in metrics:
            va, vb = [fn(r) for r in a[pol]], [fn(r) for r in b[pol]]
            ma, mb = st.median(va), st.median(vb)
            ok = min(va) <= mb <= max(va) or min(vb) <= ma <= max(vb)
            total += 1
            inside += ok
            rows.append(f"| {name[:-5]} | {pol} | {m} | {ma:,.1f} [{min(va):,.1f}-{max(va):,.1f}] | {mb:,.1f} [{min(vb):,.1f}-{max(vb):,.1f}] | {'yes' if ok else '**no**'} |")
print("| cell | policy | metric | before: median [min-max] | after | within spread |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
print(f"\n{inside} of {total} within spread")
