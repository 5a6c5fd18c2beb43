// Calls a running hub with the TypeScript package and @connectrpc/connect-node:
// LinkService.ListLinks, then ResourceService.List of the namespaces of one
// member cluster. Prints one JSON object on stdout.
//
//   cd ts && npm run build
//   OTTER_HUB_URL=https://localhost:8443 OTTER_TOKEN_FILE=../otter-data/admin-token \
//     OTTER_CA_FILE=hub-ca.crt node examples/list-links.mjs
//
// Environment:
//   OTTER_HUB_URL       the hub's API URL (required)
//   OTTER_TOKEN         API token, or OTTER_TOKEN_FILE: a file holding it
//   OTTER_CA_FILE       PEM of the CA that signed the hub's API certificate
//                       (optional: the system roots otherwise)
//   OTTER_CLUSTER       cluster for the Resource call (default: the first link;
//                       no Resource call when there is none)
//   OTTER_PROTOCOL      "connect" (default), "grpc" or "grpcweb"
//   OTTER_HTTP_VERSION  "2" (default) or "1.1" (not for gRPC)
//   OTTER_BINARY        "1" for the binary encoding instead of JSON (Connect
//                       and gRPC-Web; gRPC is always binary)
import { readFileSync } from "node:fs";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import { linkv1, resourcev1 } from "@otterscale/link-api";

function env(name) {
  const value = process.env[name];
  return value === undefined || value === "" ? undefined : value;
}

const baseUrl = env("OTTER_HUB_URL");
if (!baseUrl) {
  console.error("set OTTER_HUB_URL (and OTTER_TOKEN or OTTER_TOKEN_FILE)");
  process.exit(2);
}
const tokenFile = env("OTTER_TOKEN_FILE");
const token = env("OTTER_TOKEN") ?? (tokenFile && readFileSync(tokenFile, "utf8").trim());
const caFile = env("OTTER_CA_FILE");

// Adds `Authorization: Bearer <token>` to every call.
const bearer = (next) => async (req) => {
  if (token) req.header.set("Authorization", `Bearer ${token}`);
  return next(req);
};

const protocol = env("OTTER_PROTOCOL") ?? "connect";
const create = {
  connect: createConnectTransport,
  grpc: createGrpcTransport,
  grpcweb: createGrpcWebTransport,
}[protocol];
if (!create) {
  console.error(`OTTER_PROTOCOL must be connect, grpc or grpcweb, not ${protocol}`);
  process.exit(2);
}
const transport = create({
  baseUrl,
  httpVersion: protocol === "grpc" ? "2" : (env("OTTER_HTTP_VERSION") ?? "2"),
  useBinaryFormat: protocol === "grpc" || env("OTTER_BINARY") === "1",
  interceptors: [bearer],
  nodeOptions: caFile ? { ca: readFileSync(caFile) } : {},
});

const links = createClient(linkv1.LinkService, transport);
const resources = createClient(resourcev1.ResourceService, transport);

try {
  const listed = await links.listLinks({});
  const result = {
    links: listed.links.map((l) => ({
      cluster: l.cluster,
      state: linkv1.LinkState[l.state ?? 0],
      transport: l.transport,
    })),
  };
  const cluster = env("OTTER_CLUSTER") ?? listed.links[0]?.cluster;
  if (cluster) {
    const namespaces = await resources.list({ cluster, version: "v1", resource: "namespaces" });
    result.cluster = cluster;
    result.namespaces = namespaces.items.map((item) => item.object?.metadata?.name);
  }
  console.log(JSON.stringify(result));
} catch (err) {
  const e = ConnectError.from(err);
  console.error(`${Code[e.code]}: ${e.rawMessage}`);
  process.exit(1);
}
