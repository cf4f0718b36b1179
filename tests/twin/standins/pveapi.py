#!/usr/bin/python3
"""Twin stand-in for the Proxmox API: HTTPS on <address>:8006, /api2/json/..., API tokens.

Runs INSIDE the twin (chroot, stdlib only), so it sees the twin's /etc/pve and serves every
request with the same functions the `pvesh` stand-in uses (`api()` of the proxmox stand-in,
/usr/local/lib/twin/proxmox.py): a write through the API and one through pvesh change the
same files the same way.

    python3 /usr/local/lib/twin/pveapi.py --listen 127.0.0.N [--port 8006]

At start it makes a self-signed certificate for the listen address with `openssl`
(/etc/pve/local/pve-ssl.pem + .key; the certificate is its own CA, like a copy of
/etc/pve/pve-root-ca.pem for the client) unless one exists, writes its pid to
/run/pveapi.pid and serves until killed.

Authentication as Proxmox's: `Authorization: PVEAPIToken=USER!TOKENNAME=SECRET`, checked
against /etc/pve/priv/token.cfg (lines `USER!TOKENNAME SECRET`, read on every request);
anything else is 401. Methods: GET = get, POST = create, PUT = set, DELETE = delete;
parameters from the query string and from form or JSON bodies (repeated keys kept, as
`map=...&map=...`). Replies `{"data": ...}`; errors as Proxmox sends them: 400 with
`{"data": null, "errors": {param: message}}` for parameter errors, 500 with the message as
the HTTP reason otherwise. Each request is logged (method, path, status; never headers) to
/var/log/pveapi.log.
"""
import argparse
import hmac
import http.server
import importlib.machinery
import importlib.util
import json
import os
import ssl
import subprocess
import sys
import urllib.parse

sys.dont_write_bytecode = True

CERT = "/etc/pve/local/pve-ssl.pem"
KEY = "/etc/pve/local/pve-ssl.key"
TOKENS = "/etc/pve/priv/token.cfg"
LOG = "/var/log/pveapi.log"
PIDFILE = "/run/pveapi.pid"


def load_proxmox_standin():
    """The pvesh stand-in's Python as a module (/usr/local/lib/twin/proxmox.py; the program
    /usr/local/sbin/pvesh is the stand-in client, tests/twin/standins/client.c)."""
    path = os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin/proxmox.py")
    loader = importlib.machinery.SourceFileLoader("proxmox_standin", path)
    spec = importlib.util.spec_from_loader("proxmox_standin", loader)
    assert spec is not None  # spec_from_loader with a loader gives one
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


pve = load_proxmox_standin()
ts = pve.ts


def known_tokens():
    """{"root@pam!pvegpu": "secret"} from token.cfg."""
    tokens = {}
    for line in (ts.read(TOKENS) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            tokens[parts[0]] = parts[1]
    return tokens


def authorized(header):
    """Is `PVEAPIToken=USER!NAME=SECRET` a known token with its secret?"""
    if not header or not header.startswith("PVEAPIToken="):
        return False
    token_id, sep, secret = header[len("PVEAPIToken="):].partition("=")
    if not sep or "!" not in token_id:
        return False
    want = known_tokens().get(token_id)
    return want is not None and hmac.compare_digest(want.encode(), secret.encode())


def error_reply(message):
    """ApiError text -> (status, reason, body) as Proxmox's HTTP server answers."""
    first, _, rest = message.partition("\n")
    if first.startswith("400 "):
        errors = {}
        for line in rest.splitlines():
            key, sep, msg = line.partition(": ")
            if sep:
                errors[key] = msg
        return 400, first[4:], {"data": None, "errors": errors}
    return 500, message.replace("\n", " "), {"data": None}


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "pve-api-daemon/3.0"

    def log_message(self, fmt, *args):  # stdout/stderr are /dev/null; our log has no headers
        pass

    def _params(self):
        url = urllib.parse.urlsplit(self.path)
        params = urllib.parse.parse_qsl(url.query, keep_blank_values=True)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        if body:
            if (self.headers.get("Content-Type") or "").startswith("application/json"):
                for k, v in json.loads(body).items():
                    for item in (v if isinstance(v, list) else [v]):
                        params.append((k, str(item)))
            else:
                params += urllib.parse.parse_qsl(body, keep_blank_values=True)
        return url.path, params

    def _reply(self, status, body, reason=None):
        data = json.dumps(body).encode()
        self.send_response(status, reason)
        self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method):
        path, params = self._params()
        if not authorized(self.headers.get("Authorization")):
            status, reason, body = 401, "authentication failure", {"data": None}
        elif not path.startswith("/api2/json/"):
            status, reason, body = 501, f"Unexpected content for '{path}'", {"data": None}
        else:
            try:
                status, reason, body = 200, None, {"data": pve.api(method, path[len("/api2/json"):], params)}
            except pve.ApiError as e:
                status, reason, body = error_reply(str(e))
        with open(ts.path(LOG), "a") as log:
            log.write(f"{ts.now_iso()} {self.command} {path} {status}\n")
        self._reply(status, body, reason)

    def do_GET(self):
        self._handle("get")

    def do_POST(self):
        self._handle("create")

    def do_PUT(self):
        self._handle("set")

    def do_DELETE(self):
        self._handle("delete")


def ensure_certificate(address):
    if os.path.exists(ts.path(CERT)) and os.path.exists(ts.path(KEY)):
        return
    os.makedirs(os.path.dirname(ts.path(CERT)), exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "7", "-subj", f"/CN={address}", "-addext", f"subjectAltName=IP:{address}",
                    "-keyout", ts.path(KEY), "-out", ts.path(CERT)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="the twin's own 127.0.0.N")
    parser.add_argument("--port", type=int, default=8006)
    args = parser.parse_args(argv)
    if not args.listen.startswith("127."):
        sys.exit("pveapi: listens on loopback addresses only")
    ensure_certificate(args.listen)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(ts.path(CERT), ts.path(KEY))
    server = http.server.HTTPServer((args.listen, args.port), Handler)  # one request at a time
    server.socket = context.wrap_socket(server.socket, server_side=True)
    ts.write(PIDFILE, f"{os.getpid()}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
