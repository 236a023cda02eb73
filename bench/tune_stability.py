#!/usr/bin/env python3
"""tune_stability.py A.json B.json - how often two full tunes choose the same tile.

Issue 5's rule: a record is stable when both tunes chose the same winner, or
when their winners are within 2% of each other, judged on tune A's own
timings (A's median of B's winner against A's winner), so one run's clock
state decides, not two machines'.  Prints one line per record both DBs hold
and the total; exit 0 always (the count is the result)."""
import json
import sys


def records(path):
    with open(path) as f:
        db = json.load(f)
    return {(r["key"], r["bucket"], r["arch"]): r for r in db["records"]}


def main():
    if len(sys.argv) != 3 or sys.argv[1].startswith('-'):
        sys.exit(__doc__.split('\n\n')[0] + '\nusage: python3 bench/tune_stability.py A.json B.json')
    try:
        a, b = records(sys.argv[1]), records(sys.argv[2])
    except (OSError, ValueError, KeyError, TypeError) as err:
        sys.exit('tune_stability.py: %s: %s' % (type(err).__name__, err))
    both = sorted(set(a) & set(b))
    same = near = 0
    print("key | bucket | tune A winner (us) | tune B winner (us) | verdict (tune A's time of B's winner)")
    for k in both:
        ra, rb = a[k], b[k]
        ta, tb = ra["tile"], rb["tile"]
        if ta == tb:
            same += 1
            verdict = "same winner"
        else:
            times = {c["tile"]: c.get("median_us") for c in ra["candidates"] if c.get("median_us") is not None}
            # A re-timed its default against its winner back to back: use those.
            times[ra["tile"]] = ra["tuned_us"]
            if ra.get("default_tile"):
                times[ra["default_tile"]] = ra["default_us"]
            t = times.get(tb)
            if t is not None and t <= ra["tuned_us"] * 1.02:
                near += 1
                verdict = "different, within 2%% (%.2f vs %.2f us)" % (t, ra["tuned_us"])
            else:
                verdict = "DIFFERENT (%s vs %.2f us)" % ("%.2f" % t if t is not None else "untimed", ra["tuned_us"])
        print("%s | %s | %s (%.2f) | %s (%.2f) | %s" % (k[0], k[1], ta, ra["tuned_us"], tb, rb["tuned_us"], verdict))
    n = len(both)
    print("%d records in both (%d only in A, %d only in B): %d same winner, %d more within 2%%: %d/%d = %.1f%%"
          % (n, len(set(a) - set(b)), len(set(b) - set(a)), same, near, same + near, n, 100.0 * (same + near) / max(n, 1)))


if __name__ == "__main__":
    main()
