"""A foreign gRPC client for kerf's kubelet plugin sockets: Python grpcio (gRPC C-core).

Driven by tests/tests/grpcio_client.rs. grpcio's HTTP/2 stack is not h2's: for a `unix:`
target it sends `:authority` as the percent-encoded socket path (grpcio 1.57 and later),
or whatever `grpc.default_authority` says, and indexes it in its HPACK dynamic table, so
every later request on the connection names it by dynamic index. The Rust test checks
that the plugin answers all of it.

The script knows no protobuf: the test encodes every request with prost and decodes every
response, so calls are generic (`channel.unary_unary(method)` without serializers, bytes
in, bytes out) and no code is generated from the protos.

Input on stdin, one JSON object:

    {"sockets": {"registration": PATH, "dra": PATH},
     "configurations": [
        {"name": STR,
         "authority": null | {"registration": STR, "dra": STR},
         "calls": [{"socket": "registration" | "dra", "method": "/pkg.Service/Method",
                    "request": HEX}, ...]}]}

`authority` null leaves `grpc.default_authority` unset. Each configuration gets one new
channel per socket, each with its own connection (a local subchannel pool: channels of
the same target must not share a connection, or a later configuration would not start on
a fresh HPACK table), and its calls run in order on them.

Output on stdout, one JSON object:

    {"grpcio": VERSION,
     "configurations": [{"name": STR, "results": [
        {"ok": true, "response": HEX} | {"ok": false, "code": STR, "details": STR}]}]}

A failed call is a result, not an exit status: the test reports which call failed and how.
The exit status is non-zero only when the script itself cannot run.
"""

import json
import sys

import grpc

# Generous: a call that has not finished by then is a hang, which the test reports.
CALL_TIMEOUT_SECONDS = 30


def run_configuration(sockets, configuration):
    authority = configuration["authority"]
    channels = {}
    try:
        for name, path in sockets.items():
            options = [("grpc.use_local_subchannel_pool", 1)]
            if authority is not None:
                options.append(("grpc.default_authority", authority[name]))
            channels[name] = grpc.insecure_channel("unix:" + path, options=options)
        results = []
        for call in configuration["calls"]:
            # No serializers: grpcio sends the request bytes as they are and returns the
            # response bytes.
            method = channels[call["socket"]].unary_unary(call["method"])
            try:
                response = method(
                    bytes.fromhex(call["request"]), timeout=CALL_TIMEOUT_SECONDS
                )
                results.append({"ok": True, "response": response.hex()})
            except grpc.RpcError as error:
                results.append(
                    {
                        "ok": False,
                        "code": str(error.code()),
                        "details": str(error.details()),
                    }
                )
        return {"name": configuration["name"], "results": results}
    finally:
        for channel in channels.values():
            channel.close()


def main():
    spec = json.load(sys.stdin)
    report = {
        "grpcio": grpc.__version__,
        "configurations": [
            run_configuration(spec["sockets"], configuration)
            for configuration in spec["configurations"]
        ],
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
