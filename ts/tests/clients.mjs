// Calls a running hub with the TypeScript package over every protocol and
// codec @connectrpc/connect-node speaks: Connect, gRPC and gRPC-Web, each
// with JSON and binary messages, over HTTP/1.1 and HTTP/2. For each it makes a unary call, a call forwarded to a member
// cluster, a server-streaming call that it leaves after three events, a call
// that fails with a code, a fan-out over every cluster (FleetService, our
// own package), and a call without credentials. Prints one JSON
// object on stdout, keyed by protocol; the end-to-end test
// `real_clients.rs` asserts on it.
//
// Environment:
//   OTTER_HUB_URL   the hub's API URL (required)
//   OTTER_TOKEN     API token (required)
//   OTTER_CA_FILE   PEM of the hub CA (required: the hub's certificate is
//                   signed by its own CA)
//   OTTER_CLUSTER   member cluster for the forwarded calls (required)
import { readFileSync } from "node:fs";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import {
  createConnectTransport,
  createGrpcTransport,
  createGrpcWebTransport,
} from "@connectrpc/connect-node";
import { fleetv1, linkv1, resourcev1 } from "@otterscale/link-api";

function required(name) {
  const value = process.env[name];
  if (!value) {
    console.error(`set ${name}`);
    process.exit(2);
  }
  return value;
}

const baseUrl = required("OTTER_HUB_URL");
const token = required("OTTER_TOKEN");
const ca = readFileSync(required("OTTER_CA_FILE"));
const cluster = required("OTTER_CLUSTER");
// Every call is bounded; the test around this script has its own bound too.
const callOptions = { timeoutMs: 15000 };

const bearer = (next) => async (req) => {
  req.header.set("Authorization", `Bearer ${token}`);
  return next(req);
};
// A user of another tenant, when given: the cluster must look absent to it.
const otherToken = process.env.OTTER_OTHER_TENANT_TOKEN;
const otherBearer = (next) => async (req) => {
  req.header.set("Authorization", `Bearer ${otherToken}`);
  return next(req);
};

// Every protocol and codec connect-node offers, over the HTTP versions
// each runs on. `rounds`: how many refused/served pairs the keep-alive
// check makes (a hundred where HTTP/1.1 carries it).
const connect = (httpVersion, useBinaryFormat) => (interceptors) =>
  createConnectTransport({ baseUrl, httpVersion, useBinaryFormat, interceptors, nodeOptions: { ca } });
const grpcWeb = (httpVersion, useBinaryFormat) => (interceptors) =>
  createGrpcWebTransport({ baseUrl, httpVersion, useBinaryFormat, interceptors, nodeOptions: { ca } });
const grpc = (useBinaryFormat) => (interceptors) =>
  createGrpcTransport({ baseUrl, useBinaryFormat, interceptors, nodeOptions: { ca } });
const protocols = {
  "connect-json-h1": { make: connect("1.1", false), rounds: 100 },
  "connect-json-h2": { make: connect("2", false), rounds: 10 },
  "connect-binary-h1": { make: connect("1.1", true), rounds: 100 },
  "connect-binary-h2": { make: connect("2", true), rounds: 10 },
  "grpc-binary": { make: grpc(true), rounds: 10 },
  "grpc-json": { make: grpc(false), rounds: 10 },
  "grpc-web-binary-h1": { make: grpcWeb("1.1", true), rounds: 100 },
  "grpc-web-json-h1": { make: grpcWeb("1.1", false), rounds: 100 },
  "grpc-web-binary-h2": { make: grpcWeb("2", true), rounds: 10 },
  "grpc-web-json-h2": { make: grpcWeb("2", false), rounds: 10 },
};

// The code name of a failed call; "OK" when it did not fail.
async function codeOf(call) {
  try {
    await call();
    return "OK";
  } catch (err) {
    const e = ConnectError.from(err);
    return { code: Code[e.code], message: e.rawMessage };
  }
}

async function exercise(makeTransport, rounds) {
  const transport = makeTransport([bearer]);
  const links = createClient(linkv1.LinkService, transport);
  const resources = createClient(resourcev1.ResourceService, transport);
  const out = {};

  const listed = await links.listLinks({}, callOptions);
  out.links = listed.links.map((l) => ({
    cluster: l.cluster,
    state: linkv1.LinkState[l.state ?? 0],
    agentId: l.agentId,
  }));

  const got = await resources.get(
    { cluster, version: "v1", resource: "pods", namespace: "default", name: "web" },
    callOptions,
  );
  out.get = got.object;

  // Server streaming: three events, then leave (the break aborts the call).
  const abort = new AbortController();
  const events = [];
  const watch = resources.watch(
    { cluster, version: "v1", resource: "pods" },
    { signal: abort.signal, timeoutMs: 15000 },
  );
  try {
    for await (const ev of watch) {
      events.push({
        type: resourcev1.WatchEvent_Type[ev.type ?? 0],
        resourceVersion: ev.resourceVersion,
        payload: ev.resource?.object?.payload,
      });
      if (events.length === 3) {
        abort.abort();
        break;
      }
    }
  } catch (err) {
    // Aborting may surface as Canceled, depending on timing; anything else
    // is a failure of the stream.
    if (ConnectError.from(err).code !== Code.Canceled) throw err;
  }
  out.watch = events;

  // A fan-out: one answer per cluster, streamed.
  const fanOut = (client) => async () => {
    const answers = [];
    const stream = client.listResources(
      { fanOut: { linkSelector: "" }, version: "v1", resource: "pods" },
      callOptions,
    );
    for await (const a of stream) {
      answers.push({
        cluster: a.cluster,
        result: a.result.case,
        items: a.result.case === "list" ? a.result.value.items.length : undefined,
        code: a.result.case === "error" ? a.result.value.code : undefined,
      });
    }
    return answers;
  };
  out.fanOut = await fanOut(createClient(fleetv1.FleetService, transport))();

  out.unknownCluster = await codeOf(() =>
    resources.get(
      { cluster: "no-such-cluster", version: "v1", resource: "pods", name: "web" },
      callOptions,
    ),
  );

  if (otherToken) {
    const other = createClient(resourcev1.ResourceService, makeTransport([otherBearer]));
    const ask = (c) =>
      codeOf(() =>
        other.get({ cluster: c, version: "v1", resource: "pods", name: "web" }, callOptions),
      );
    out.otherTenant = { theirs: await ask(cluster), absent: await ask("no-such-cluster") };
    const otherFleet = createClient(fleetv1.FleetService, makeTransport([otherBearer]));
    out.otherTenant.fanOut = await fanOut(otherFleet)();
  }

  const anonymous = createClient(linkv1.LinkService, makeTransport([]));
  out.noToken = await codeOf(() => anonymous.listLinks({}, callOptions));

  // On one transport (one keep-alive pool), calls the hub refuses from their
  // headers, before reading the body, alternate with calls it serves: each
  // gets its own answer, none a broken connection.
  let withToken = true;
  const sometimes = (next) => async (req) => {
    if (withToken) req.header.set("Authorization", `Bearer ${token}`);
    return next(req);
  };
  const mixed = createClient(linkv1.LinkService, makeTransport([sometimes]));
  const answers = [];
  for (let i = 0; i < rounds; i++) {
    withToken = false;
    // The expected code alone; anything else with its message.
    const answer = (a, expected) =>
      a === "OK" || a.code === expected ? (a.code ?? a) : `${a.code}: ${a.message}`;
    const refused = await codeOf(() => mixed.listLinks({}, callOptions));
    answers.push(answer(refused, "Unauthenticated"));
    withToken = true;
    const served = await codeOf(() => mixed.listLinks({}, callOptions));
    answers.push(answer(served, "OK"));
  }
  out.earlyReplies = answers;
  return out;
}

const result = {};
for (const [name, { make, rounds }] of Object.entries(protocols)) {
  try {
    result[name] = await exercise(make, rounds);
  } catch (err) {
    const e = ConnectError.from(err);
    result[name] = { failed: `${Code[e.code]}: ${e.rawMessage}` };
  }
}
console.log(JSON.stringify(result));
