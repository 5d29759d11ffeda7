// Runs Perfetto's trace_processor.wasm (as shipped in the Perfetto UI bundle,
// engine_bundle.js + trace_processor.wasm) under Node.js and exposes its raw
// RPC byte stream (TraceProcessorRpcStream protos) on a Unix socket, i.e. the
// same protocol as `trace_processor server unix`.
// Usage: node tp_wasm_bridge.js <dir with engine_bundle.js> <socket path>
'use strict';
const fs = require('fs');
const path = require('path');
const net = require('net');
const vm = require('vm');

const [dir, sockPath] = process.argv.slice(2);
if (!dir || !sockPath) {
  console.error('usage: node tp_wasm_bridge.js <ui_dist_dir> <socket>');
  process.exit(2);
}

// Pretend to be a web worker: the emscripten glue was built for web/worker.
process.type = 'renderer';  // defeats emscripten's "is node" detection
globalThis.WorkerGlobalScope = function WorkerGlobalScope() {};
globalThis.self = globalThis;
globalThis.location = {href: 'http://localhost/engine_bundle.js',
                       protocol: 'http:', host: 'localhost'};
// Synchronous XHR is what the worker glue uses to fetch the .wasm file.
globalThis.XMLHttpRequest = class {
  open(_method, url) { this.url = String(url); }
  send() {
    const buf = fs.readFileSync(path.join(dir, path.basename(this.url)));
    this.status = 200;
    this.response = buf.buffer.slice(buf.byteOffset, buf.byteOffset + buf.length);
  }
};

// Keep emscripten's stdout/stderr off our stdout.
const log = (...a) => process.stderr.write(a.join(' ') + '\n');
console.log = log; console.warn = log; console.info = log;

vm.runInThisContext(fs.readFileSync(path.join(dir, 'engine_bundle.js'), 'utf8'),
                    {filename: 'engine_bundle.js'});
if (typeof self.onmessage !== 'function') {
  console.error('engine_bundle.js did not install a worker onmessage handler');
  process.exit(1);
}

let client = null;
const pending = [];
const port = {
  onmessage: null,
  postMessage(bytes) {  // reply bytes from the wasm
    const b = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    if (client) client.write(b); else pending.push(b);
  },
};
self.onmessage({data: port});

try { fs.unlinkSync(sockPath); } catch (_) {}
const server = net.createServer((sock) => {
  client = sock;
  for (const b of pending.splice(0)) sock.write(b);
  sock.on('data', (chunk) => {
    try {
      port.onmessage({data: new Uint8Array(chunk)});
    } catch (e) {
      console.error(String(e && e.stack || e));
      process.exit(1);
    }
  });
  sock.on('close', () => { server.close(); process.exit(0); });
});
// Runtime init completes in a microtask after the module is instantiated
// synchronously; start listening only after that.
setImmediate(() => server.listen(
    sockPath, () => process.stderr.write('READY ' + sockPath + '\n')));
