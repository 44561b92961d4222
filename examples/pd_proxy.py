"""A minimal prefill/decode proxy for vLLM's OpenAI server: what P/D proxies do, and no more.

    python examples/pd_proxy.py --prefill http://HOST:PORT --decode http://HOST:PORT [--port 8100]

``POST /v1/completions`` goes to the prefill server first, with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; the ``kv_transfer_params`` it returns go,
unchanged, into the original request sent to the decode server, whose response is the answer.
With routed-experts-cache on both servers those parameters carry the prompt's routed-expert
rows, so the decode server returns rows for the whole sequence without computing the prompt.
"""

import argparse
import json
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def make_proxy(prefill: str, decode: str, port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """The proxy's HTTP server (``serve_forever`` runs it; port 0: any free port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/v1/completions":
                return self._answer(404, json.dumps({"error": f"{self.path}: only /v1/completions"}).encode())
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, answer = post(f"{prefill}/v1/completions", {
                **body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True},
            })
            if status != 200:
                return self._answer(status, answer)
            carried = json.loads(answer).get("kv_transfer_params")
            self._answer(*post(f"{decode}/v1/completions", {**body, "kv_transfer_params": carried}))

        def _answer(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):  # quiet
            return None

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL (without /v1)")
    parser.add_argument("--decode", required=True, help="the decode server's base URL (without /v1)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    proxy = make_proxy(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.port, args.host)
    print(f"P/D proxy on http://{args.host}:{proxy.server_port}/v1 -> {args.prefill} then {args.decode}", flush=True)
    proxy.serve_forever()


if __name__ == "__main__":
    main()
