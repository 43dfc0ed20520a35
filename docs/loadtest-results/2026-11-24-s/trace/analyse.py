import json,sys,collections
rows=[r for r in (json.loads(l) for l in open(sys.argv[1])) if 'late' not in r]
by=collections.defaultdict(list)
for r in rows: by[r['sid']].append(r)
margins=collections.defaultdict(list)
worst=[]
for sid,rs in by.items():
    rs.sort(key=lambda r:r['seq'])
    prev_sent=0
    for r in rs:
        m=prev_sent-r['emit'] if r['seq']>0 else None
        if m is not None:
            margins[r['seq']].append(m); worst.append((m,sid,r['seq']))
        prev_sent=r['sent']
for k in sorted(margins):
    v=sorted(margins[k]); n=len(v)
    print(f"seq {k}: n={n} min {v[0]*1e3:.1f} p5 {v[int(n*.05)]*1e3:.1f} p50 {v[n//2]*1e3:.1f} ms")
worst.sort()
for m,sid,seq in worst[:int(sys.argv[2]) if len(sys.argv)>2 else 6]:
    print(f"--- margin {m*1e3:.1f} ms sid {sid} seq {seq}")
    for r in by[sid][:seq+1]:
        print({k:r[k] for k in r if k!='sid'})
