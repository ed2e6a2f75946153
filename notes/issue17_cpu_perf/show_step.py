import json, sys, statistics as st
from collections import defaultdict
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
g = defaultdict(list)
for r in rows:
    g[(r['env'], r['row']['dtype'], r['ver'])].append(r)
print("%-6s %-9s %-5s %5s | %8s %8s %8s | %7s %7s %7s | loads" % ("env","dtype","ver","n","fused","unfused","plain","f/unf","f/pl","unf/pl"))
for k in sorted(g):
    rs = g[k]; R = [r['row'] for r in rs]
    med = lambda key: st.median(x[key] for x in R)
    print("%-6s %-9s %-5s %5d | %8.1f %8.1f %8.1f | %7.3f %7.3f %7.3f | %s" % (*k, len(R), med('fused_ms'), med('unfused_ms'), med('plain_ms'), med('fused_over_unfused'), med('fused_over_plain'), med('unfused_over_plain'), ",".join(r['load'] for r in rs)))
