import json, struct, sys
def load(p):
    b = open(p, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    h = json.loads(b[8:8+n])
    return h, b[8+n:]
ha, da = load(sys.argv[1]); hb, db = load(sys.argv[2])
meta_a = ha.pop('__metadata__', {}); meta_b = hb.pop('__metadata__', {})
diff_meta = {k: (meta_a.get(k), meta_b.get(k)) for k in set(meta_a) | set(meta_b) if meta_a.get(k) != meta_b.get(k)}
same = da == db
print('data identical' if same else 'DATA DIFFERENT', '| metadata differences:', {k: (str(v[0])[:40], str(v[1])[:40]) for k, v in list(diff_meta.items())[:4]})
if not same:
    import array
    bad = [k for k in ha if da[ha[k]['data_offsets'][0]:ha[k]['data_offsets'][1]] != db[hb[k]['data_offsets'][0]:hb[k]['data_offsets'][1]]]
    print('tensors differing:', len(bad), bad[:6])
