#!/usr/bin/env python3
"""A stand-in for grpcurl, for the README check on machines without it.

It takes the subset of grpcurl's command line the README uses and does what
grpcurl does with it: asks the server's reflection service for the method's
message types (no .proto files), turns the JSON request into protobuf with
those types, calls the method with a real gRPC client (grpcio), and prints
the answer as protobuf JSON. An unknown field name or a wrong type in the
JSON fails as it would in grpcurl, so a README example that the real
grpcurl would refuse fails here too.

    grpcurl.py -plaintext [-H 'NAME: VALUE']... [-d JSON | -d @] ADDRESS SERVICE/METHOD

`-H` adds a header to the call (an API key: `-H 'authorization: Bearer
KEY'`); `-d @` reads the JSON from standard input. Anything else is refused.
"""

import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from google.rpc import error_details_pb2  # noqa: F401 (registers ErrorInfo & co. for the details)
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from grpc_status import rpc_status


def usage(why):
    sys.exit(f"grpcurl.py: {why}\nusage: grpcurl.py -plaintext [-H 'NAME: VALUE']... [-d JSON|@] ADDRESS SERVICE/METHOD")


def parse(argv):
    plaintext, data, headers, positional = False, "{}", [], []
    args = iter(argv)
    for arg in args:
        if arg == "-plaintext":
            plaintext = True
        elif arg == "-H":
            header = next(args, None)
            if header is None or ":" not in header:
                usage("-H needs 'NAME: VALUE'")
            name, value = header.split(":", 1)
            headers.append((name.strip().lower(), value.strip()))
        elif arg == "-d":
            data = next(args, None)
            if data is None:
                usage("-d needs a value")
            if data == "@":
                data = sys.stdin.read()
        elif arg.startswith("-"):
            usage(f"flag {arg} is not supported by this stand-in")
        else:
            positional.append(arg)
    if not plaintext:
        usage("only -plaintext connections are supported")
    if len(positional) != 2 or "/" not in positional[1]:
        usage("need ADDRESS and SERVICE/METHOD")
    return data, headers, positional[0], positional[1]


def print_error(e):
    """As grpcurl prints a failed call: the code, the message, and the
    status details (google.rpc.ErrorInfo and the like) as JSON."""
    code = "".join(w.capitalize() for w in e.code().name.split("_"))
    print(f"ERROR:\n  Code: {code}\n  Message: {e.details()}", file=sys.stderr)
    status = rpc_status.from_call(e)
    if status is not None and status.details:
        print("  Details:", file=sys.stderr)
        for i, detail in enumerate(status.details, 1):
            text = json_format.MessageToJson(detail, indent=2).replace("\n", "\n    \t")
            print(f"  {i})\t{text}", file=sys.stderr)


def main():
    data, headers, address, target = parse(sys.argv[1:])
    service_name, method_name = target.rsplit("/", 1)
    with grpc.insecure_channel(address) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        try:
            service = pool.FindServiceByName(service_name)
        except KeyError:
            sys.exit(f"Error: service {service_name!r} not found by reflection")
        method = service.methods_by_name.get(method_name)
        if method is None:
            sys.exit(f"Error: service {service_name!r} has no method {method_name!r}")
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        try:
            request = json_format.Parse(data, request_type())
        except json_format.ParseError as e:
            sys.exit(f"Error invoking method {target!r}: {e}")
        call = channel.unary_unary(
            f"/{service.full_name}/{method.name}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        try:
            response = call(request, timeout=30, metadata=headers or None)
        except grpc.RpcError as e:
            print_error(e)
            sys.exit(1)
        print(json_format.MessageToJson(response, indent=2))


if __name__ == "__main__":
    main()
