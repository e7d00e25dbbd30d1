#!/usr/bin/env node
// The object-storage tests' server: s3rver (a loopback S3-compatible server,
// installed by scripts/setup) and, in front of it, a small proxy that adds
// what s3rver lacks and what the tests inject.
//
//   node --openssl-legacy-provider tests/s3/server.js <data dir> <ports file> [bucket...]
//
// Run it with node --openssl-legacy-provider: s3rver makes its ListObjectsV2
// continuation tokens with DES, which OpenSSL 3 keeps in its legacy provider.
// Both listen on 127.0.0.1 on ephemeral ports; <ports file> gets
// {"s3rver": N, "proxy": M, "pid": P} once both are up. Clients use the
// proxy (AWS_ENDPOINT_URL=http://127.0.0.1:M, credentials S3RVER/S3RVER).
// The process stops by itself after CKPT_S3_SERVER_LIFETIME seconds (default
// 1800) so that a test killed before its cleanup leaves nothing behind.
//
// What the proxy adds to s3rver:
// - PUT with If-None-Match: * answers 412 when the key exists, and
//   PUT with If-Match: <etag> answers 412 unless the key exists with that
//   ETag; conditional PUTs of one key are serialised, so of two writers
//   racing for a key exactly one wins (S3's conditional writes);
// - AbortMultipartUpload (DELETE ?uploadId=) answers 204 and drops the parts;
// - CopyObject and UploadPartCopy honour x-amz-copy-source-if-match (412
//   unless the source has that ETag), and UploadPartCopy (which s3rver does
//   not implement) is done here: the source's range read from s3rver and
//   uploaded as the part;
// - faults, set by the test: POST /__proxy/faults with a JSON list of rules
//     {"method": "PUT", "key": "<regex on the key>", "query": "<regex>",
//      "action": "status" | "slow" | "hold" | "drop" | "cut", "status": 503,
//      "delay_ms": 3000, "count": N, "after": K}
//   a rule skips its first `after` matches, then acts on the next `count`
//   (-1: all): "status" answers that status with an S3 error body, "slow"
//   holds the request delay_ms before forwarding it, "hold" holds it until
//   POST /__proxy/release (or reset) forwards every held one, "drop" closes the
//   connection without an answer, "cut" forwards and closes the connection
//   half-way through the answer's body;
// - Signature V4 checked on every request (s3rver 3.7.1 checks only that the
//   access key exists): the canonical request rebuilt from what arrived, the
//   signature recomputed with the secret of the key (S3RVER/S3RVER, or
//   CKPT_S3_TEST_KEY/CKPT_S3_TEST_SECRET), and a signed payload's SHA-256
//   compared with the body: 403 SignatureDoesNotMatch, 400
//   XAmzContentSHA256Mismatch. A second implementation of the signature,
//   written apart from the client's;
// - GET /__proxy/stats: requests seen per method (GET, PUT, ...) and per
//   kind (req_list, req_get, req_head, req_put, req_part, req_copy,
//   req_part_copy, req_initiate, req_complete, req_delete, req_abort),
//   bytes received in bodies (bytes_in) and sent (bytes_out), faults
//   injected (fault_hold: requests held so far); POST /__proxy/reset: no
//   rules, counters at zero, held requests forwarded.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const http = require('http');
const path = require('path');

const [dataDir, portsFile, ...buckets] = process.argv.slice(2);
if (!dataDir || !portsFile) {
  console.error('usage: server.js <data dir> <ports file> [bucket...]');
  process.exit(2);
}
const modDir = process.env.CKPT_S3RVER_DIR;
const S3rver = require(modDir ? path.join(modDir, 'node_modules', 's3rver') : 's3rver');

let rules = [];
let stats = {};
let held = []; // the forwarding of each request a "hold" rule holds
const keyLocks = new Map();

function count(what) {
  stats[what] = (stats[what] || 0) + 1;
}

// "/bucket/key..." -> [bucket, key]
function splitPath(p) {
  const m = /^\/([^/?]+)(?:\/([^?]*))?/.exec(p);
  if (!m) return [null, null];
  return [m[1], m[2] ? decodeURIComponent(m[2]) : ''];
}

function objectFile(bucket, key) {
  const parts = key.split('/');
  const last = parts.pop();
  return path.join(dataDir, bucket, ...parts, `${last}._S3rver_object`);
}

function currentEtag(bucket, key) {
  const f = objectFile(bucket, key);
  if (!fs.existsSync(f)) return null;
  try {
    return '"' + fs.readFileSync(f + '.md5').toString().trim() + '"';
  } catch (e) {
    return '""';
  }
}

// What a request is, for the counters.
function kindOf(req, query) {
  const q = (name) => new RegExp('(^|&)' + name + '(=|&|$)').test(query);
  const copy = 'x-amz-copy-source' in req.headers;
  switch (req.method) {
    case 'GET':
      return q('list-type') ? 'list' : 'get';
    case 'HEAD':
      return 'head';
    case 'PUT':
      if (q('uploadId')) return copy ? 'part_copy' : 'part';
      return copy ? 'copy' : 'put';
    case 'POST':
      if (q('uploads')) return 'initiate';
      if (q('uploadId')) return 'complete';
      return 'post';
    case 'DELETE':
      return q('uploadId') ? 'abort' : 'delete';
    default:
      return 'other';
  }
}

function s3Error(res, status, code, message) {
  const body =
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>' +
    code +
    '</Code><Message>' +
    message +
    '</Message></Error>';
  res.writeHead(status, {
    'Content-Type': 'application/xml',
    'Content-Length': Buffer.byteLength(body),
  });
  res.end(body);
}

const secrets = { S3RVER: 'S3RVER' };
if (process.env.CKPT_S3_TEST_KEY) {
  secrets[process.env.CKPT_S3_TEST_KEY] = process.env.CKPT_S3_TEST_SECRET || '';
}

function rfc3986(s) {
  return encodeURIComponent(s).replace(/[!'()*]/g, (c) => '%' + c.charCodeAt(0).toString(16).toUpperCase());
}

// null if the request's Signature V4 holds, else [status, code, message].
function checkSignature(req, body) {
  const auth = req.headers['authorization'];
  if (!auth) return [403, 'AccessDenied', 'Anonymous access is not allowed'];
  const m = /^AWS4-HMAC-SHA256 Credential=([^/]+)\/(\d{8})\/([^/]+)\/s3\/aws4_request, ?SignedHeaders=([a-z0-9;-]+), ?Signature=([0-9a-f]{64})$/.exec(auth);
  if (!m) return [400, 'AuthorizationHeaderMalformed', 'The authorization header is malformed'];
  const [, key, day, region, signedHeaders, signature] = m;
  if (!(key in secrets)) {
    return [403, 'InvalidAccessKeyId', 'The AWS Access Key Id you provided does not exist in our records.'];
  }
  const amzDate = req.headers['x-amz-date'] || '';
  const payload = req.headers['x-amz-content-sha256'] || '';
  if (payload !== 'UNSIGNED-PAYLOAD') {
    const h = crypto.createHash('sha256').update(body).digest('hex');
    if (h !== payload) {
      return [400, 'XAmzContentSHA256Mismatch', 'The provided x-amz-content-sha256 header does not match what was computed.'];
    }
  }
  const qi = req.url.indexOf('?');
  const rawPath = qi >= 0 ? req.url.slice(0, qi) : req.url;
  const uri = rawPath.split('/').map((seg) => rfc3986(decodeURIComponent(seg))).join('/');
  const query = qi >= 0 ? req.url.slice(qi + 1) : '';
  const params = query
    ? query.split('&').map((kv) => {
        const i = kv.indexOf('=');
        const k = decodeURIComponent(i >= 0 ? kv.slice(0, i) : kv);
        const v = decodeURIComponent(i >= 0 ? kv.slice(i + 1) : '');
        return [rfc3986(k), rfc3986(v)];
      })
    : [];
  params.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0));
  const names = signedHeaders.split(';');
  const canonHeaders = names
    .map((n) => n + ':' + String(req.headers[n] === undefined ? '' : req.headers[n]).trim().replace(/\s+/g, ' ') + '\n')
    .join('');
  const creq = [req.method, uri, params.map((p) => p[0] + '=' + p[1]).join('&'), canonHeaders, signedHeaders, payload].join('\n');
  const scope = `${day}/${region}/s3/aws4_request`;
  const sts = ['AWS4-HMAC-SHA256', amzDate, scope, crypto.createHash('sha256').update(creq).digest('hex')].join('\n');
  let k = 'AWS4' + secrets[key];
  for (const part of [day, region, 's3', 'aws4_request']) {
    k = crypto.createHmac('sha256', k).update(part).digest();
  }
  const want = crypto.createHmac('sha256', k).update(sts).digest('hex');
  if (want !== signature || !names.includes('host') || amzDate.slice(0, 8) !== day) {
    return [403, 'SignatureDoesNotMatch', 'The request signature we calculated does not match the signature you provided. Check your key and signing method.'];
  }
  return null;
}

function matchRule(req, key, query) {
  for (const r of rules) {
    if (r.method && r.method !== req.method) continue;
    if (r.key && !new RegExp(r.key).test(key)) continue;
    if (r.query !== undefined && !new RegExp(r.query).test(query)) continue;
    if (r.count === 0) continue;
    if (r.after > 0) {
      r.after--;
      continue;
    }
    if (r.count > 0) r.count--;
    return r;
  }
  return null;
}

function forward(req, res, body, upstreamPort, cut) {
  const up = http.request(
    {
      host: '127.0.0.1',
      port: upstreamPort,
      method: req.method,
      path: req.url,
      headers: req.headers,
    },
    (ur) => {
      res.writeHead(ur.statusCode, ur.headers);
      ur.on('data', (d) => (stats.bytes_out = (stats.bytes_out || 0) + d.length));
      if (!cut) {
        ur.pipe(res);
        return;
      }
      const total = Number(ur.headers['content-length'] || 0);
      let sent = 0;
      ur.on('data', (chunk) => {
        if (sent >= total / 2) return;
        const take = Math.min(chunk.length, Math.max(1, Math.floor(total / 2) - sent));
        res.write(chunk.subarray(0, take));
        sent += take;
        if (sent >= total / 2) {
          ur.destroy();
          res.socket.destroy();
        }
      });
      ur.on('end', () => res.socket && res.socket.destroy());
    },
  );
  up.on('error', (e) => s3Error(res, 502, 'BadGateway', String(e)));
  up.end(body);
}

// "/bucket/key" of x-amz-copy-source -> [bucket, key]
function copySource(h) {
  const p = decodeURIComponent(h.startsWith('/') ? h.slice(1) : h);
  const i = p.indexOf('/');
  return i < 0 ? [p, ''] : [p.slice(0, i), p.slice(i + 1)];
}

// CopyObject (forwarded to s3rver) and UploadPartCopy (done here), with
// x-amz-copy-source-if-match checked first.
function copyObject(req, res, body, upstreamPort, query, cut) {
  const [sb, sk] = copySource(req.headers['x-amz-copy-source']);
  const want = req.headers['x-amz-copy-source-if-match'];
  const etag = currentEtag(sb, sk);
  if (etag === null) return s3Error(res, 404, 'NoSuchKey', 'The specified key does not exist.');
  if (want && want !== etag) {
    count('precondition_failed');
    return s3Error(res, 412, 'PreconditionFailed',
                   'At least one of the pre-conditions you specified did not hold');
  }
  if (!/(^|&)uploadId=/.test(query)) return forward(req, res, body, upstreamPort, cut);
  const range = req.headers['x-amz-copy-source-range'];
  const m = /^bytes=(\d+)-(\d+)$/.exec(range || '');
  if (!m) return s3Error(res, 400, 'InvalidArgument', 'x-amz-copy-source-range is missing or malformed');
  const src = fs.readFileSync(objectFile(sb, sk));
  const a = Number(m[1]), b = Number(m[2]);
  if (b >= src.length || a > b) return s3Error(res, 416, 'InvalidRange', 'The requested range is not satisfiable');
  const part = src.subarray(a, b + 1);
  // the part as an unsigned upload to s3rver (it checks no signature here)
  const up = http.request(
    {
      host: '127.0.0.1',
      port: upstreamPort,
      method: 'PUT',
      path: req.url,
      headers: { 'content-length': part.length },
    },
    (ur) => {
      const got = [];
      ur.on('data', (d) => got.push(d));
      ur.on('end', () => {
        if (ur.statusCode !== 200) {
          res.writeHead(ur.statusCode, ur.headers);
          return res.end(Buffer.concat(got));
        }
        const xml =
          '<?xml version="1.0" encoding="UTF-8"?>\n<CopyPartResult><ETag>' +
          String(ur.headers.etag || '').replace(/"/g, '&quot;') +
          '</ETag></CopyPartResult>';
        res.writeHead(200, { 'Content-Type': 'application/xml', 'Content-Length': Buffer.byteLength(xml) });
        res.end(xml);
      });
    },
  );
  up.on('error', (e) => s3Error(res, 502, 'BadGateway', String(e)));
  up.end(part);
}

// Conditional writes of one key, one at a time.
function withKeyLock(id, fn) {
  const prev = keyLocks.get(id) || Promise.resolve();
  const next = prev.then(() => new Promise((resolve) => fn(resolve)));
  keyLocks.set(id, next.catch(() => {}));
  next.finally(() => {
    if (keyLocks.get(id) === next) keyLocks.delete(id);
  });
}

function handle(req, res, upstreamPort) {
  const url = req.url;
  if (url.startsWith('/__proxy/')) {
    let text = '';
    req.on('data', (d) => (text += d));
    req.on('end', () => {
      if (url === '/__proxy/faults' && req.method === 'POST') {
        const list = JSON.parse(text || '[]');
        rules = list.map((r) => ({ count: -1, after: 0, ...r }));
      } else if (url === '/__proxy/reset' || url === '/__proxy/release') {
        if (url === '/__proxy/reset') {
          rules = [];
          stats = {};
        }
        const go = held;
        held = [];
        go.forEach((f) => f());
      }
      res.writeHead(200, { 'Content-Type': 'application/json' });
      res.end(JSON.stringify(stats));
    });
    return;
  }
  const qi = url.indexOf('?');
  const query = qi >= 0 ? url.slice(qi + 1) : '';
  const [bucket, key] = splitPath(url);
  const chunks = [];
  req.on('data', (d) => chunks.push(d));
  req.on('end', () => {
    const body = Buffer.concat(chunks);
    count(req.method);
    count('req_' + kindOf(req, query));
    stats.bytes_in = (stats.bytes_in || 0) + body.length;
    const bad = checkSignature(req, body);
    if (bad) {
      count('refused_' + bad[1]);
      return s3Error(res, bad[0], bad[1], bad[2]);
    }
    const rule = matchRule(req, key || '', query);
    const go = () => {
      if (rule && rule.action === 'status') {
        count('fault_status');
        return s3Error(res, rule.status || 503, rule.status === 500 ? 'InternalError' : 'SlowDown',
                       'injected by the test proxy');
      }
      if (rule && rule.action === 'drop') {
        count('fault_drop');
        return req.socket.destroy();
      }
      const cut = !!(rule && rule.action === 'cut');
      if (cut) count('fault_cut');
      if (req.method === 'DELETE' && /(^|&)uploadId=/.test(query)) {
        count('abort_multipart');
        res.writeHead(204);
        return res.end();
      }
      const copySrc = req.headers['x-amz-copy-source'];
      if (req.method === 'PUT' && copySrc) return copyObject(req, res, body, upstreamPort, query, cut);
      const inm = req.headers['if-none-match'];
      const im = req.headers['if-match'];
      if (req.method === 'PUT' && bucket && key && (inm === '*' || im)) {
        return withKeyLock(bucket + '/' + key, (done) => {
          const etag = currentEtag(bucket, key);
          if ((inm === '*' && etag !== null) || (im && etag !== im)) {
            count('precondition_failed');
            s3Error(res, 412, 'PreconditionFailed',
                    'At least one of the pre-conditions you specified did not hold');
            return done();
          }
          res.on('finish', done);
          res.on('close', done);
          // forwarded as sent: s3rver checks the signature over these headers
          forward(req, res, body, upstreamPort, cut);
        });
      }
      forward(req, res, body, upstreamPort, cut);
    };
    if (rule && rule.action === 'hold') {
      count('fault_hold');
      held.push(go);
    } else if (rule && rule.action === 'slow') {
      count('fault_slow');
      setTimeout(go, rule.delay_ms || 3000);
    } else {
      go();
    }
  });
}

async function main() {
  fs.mkdirSync(dataDir, { recursive: true });
  const server = new S3rver({
    address: '127.0.0.1',
    port: 0,
    silent: true,
    directory: dataDir,
    vhostBuckets: false,
    configureBuckets: buckets.map((name) => ({ name })),
  });
  const addr = await server.run();
  const proxy = http.createServer((req, res) => handle(req, res, addr.port));
  proxy.keepAliveTimeout = 30000;
  await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  const info = { s3rver: addr.port, proxy: proxy.address().port, pid: process.pid };
  fs.writeFileSync(portsFile + '.tmp', JSON.stringify(info));
  fs.renameSync(portsFile + '.tmp', portsFile);
  const life = Number(process.env.CKPT_S3_SERVER_LIFETIME || 1800);
  setTimeout(() => process.exit(0), life * 1000).unref();
  const stop = () => {
    proxy.close();
    server.close().finally(() => process.exit(0));
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main().catch((e) => {
  console.error('server.js:', e);
  process.exit(1);
});
