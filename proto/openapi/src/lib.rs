//! OpenAPI 3.1 description of the OtterScale API's Connect endpoints,
//! generated from the descriptor set of `otter-proto`.
//!
//! Every unary RPC becomes `POST /<package>.<Service>/<Method>` with
//! `application/json` bodies in the canonical proto3 JSON mapping; methods
//! marked `idempotency_level = NO_SIDE_EFFECTS` also get the Connect `GET`
//! form. Non-200 answers carry a Connect error. Streaming RPCs are left
//! out: OpenAPI cannot describe Connect's enveloped streams.
//!
//! `make proto` writes [`generate`]'s output to `openapi/openapi.yaml`; a test
//! fails when the checked-in file differs.

use std::collections::{BTreeMap, HashSet};

use anyhow::{Context, Result, bail};
use prost_reflect::{
    DescriptorPool, EnumDescriptor, FieldDescriptor, FileDescriptor, Kind, MessageDescriptor,
    MethodDescriptor, ServiceDescriptor, Value,
};

pub mod yaml;

pub use yaml::Node;

/// Where a JSON schema of the document lives: `#/components/schemas/<name>`.
pub const SCHEMA_PREFIX: &str = "#/components/schemas/";

/// Component name of the Connect error body.
pub const ERROR_SCHEMA: &str = "connect.Error";

/// Name of the bearer security scheme.
pub const SECURITY_SCHEME: &str = "bearer";

/// RPCs that need no API token (they authenticate otherwise), by full name.
pub const PUBLIC_METHODS: &[&str] = &["otterscale.link.v1.LinkService.Register"];

/// Full name of the method option carrying the feature switch.
const FEATURE_EXTENSION: &str = "otterscale.api.feature";

/// The Connect error codes, in the protocol's order.
pub const CONNECT_CODES: &[&str] = &[
    "canceled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
];

/// Standard base64 with padding, as proto3 JSON emits `bytes`.
pub const BASE64_PATTERN: &str = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$";
/// A signed 64-bit integer as decimal text (at most 19 digits).
pub const INT64_PATTERN: &str = "^-?(?:0|[1-9][0-9]{0,18})$";
/// An unsigned 64-bit integer as decimal text (at most 20 digits).
pub const UINT64_PATTERN: &str = "^(?:0|[1-9][0-9]{0,19})$";
/// A Duration in proto3 JSON: seconds with up to nine fractional digits.
pub const DURATION_PATTERN: &str = "^-?[0-9]+(?:\\.[0-9]{1,9})?s$";

/// The document for the contract compiled into `otter-proto`, as YAML.
pub fn generate() -> Result<String> {
    let pool = DescriptorPool::decode(otter_proto::FILE_DESCRIPTOR_SET)
        .context("decode otter_proto::FILE_DESCRIPTOR_SET")?;
    Ok(document(&pool, env!("CARGO_PKG_VERSION"))?.to_yaml())
}

/// The document for every service of `pool`, with `version` as the API
/// document's version.
pub fn document(pool: &DescriptorPool, version: &str) -> Result<Node> {
    let mut generator = Generator::new(pool);
    let mut paths = Node::map();
    let mut tags = Vec::new();
    let mut streaming = Vec::new();
    for service in pool.services() {
        tags.push(tag(&service));
        for method in service.methods() {
            if method.is_client_streaming() || method.is_server_streaming() {
                streaming.push(format!("`{}.{}`", service.name(), method.name()));
                continue;
            }
            let path = format!("/{}/{}", service.full_name(), method.name());
            let mut item = Node::map();
            item.set("post", generator.operation(&method, false)?);
            if no_side_effects(&method) {
                item.set("get", generator.operation(&method, true)?);
            }
            paths.set(path, item);
        }
    }
    let schemas = generator.finish()?;

    Ok(Node::map()
        .with("openapi", "3.1.0")
        .with(
            "info",
            Node::map()
                .with("title", "OtterScale API (Connect)")
                .with("version", version)
                .with("description", description(&streaming))
                .with(
                    "license",
                    Node::map()
                        .with("name", "Apache-2.0")
                        .with("identifier", "Apache-2.0"),
                ),
        )
        .with(
            "servers",
            vec![
                Node::map()
                    .with("url", "https://{authority}")
                    .with(
                        "description",
                        "The hub's API port (`otter hub --listen`, published as `--external-url`).",
                    )
                    .with(
                        "variables",
                        Node::map().with(
                            "authority",
                            Node::map()
                                .with("default", "localhost:8443")
                                .with("description", "Host and port of the hub's API."),
                        ),
                    ),
            ],
        )
        .with(
            "security",
            vec![Node::map().with(SECURITY_SCHEME, Node::Seq(vec![]))],
        )
        .with("tags", tags)
        .with("paths", paths)
        .with(
            "components",
            Node::map()
                .with("schemas", schemas)
                .with("parameters", parameters())
                .with("responses", responses())
                .with("securitySchemes", security_schemes()),
        ))
}

fn description(streaming: &[String]) -> String {
    let mut text = String::from(
        "The OtterScale API as served by the OtterScale Link hub, described for plain HTTP \
clients using the Connect protocol with JSON.

- Every unary RPC is `POST /<package>.<Service>/<Method>` with `Content-Type: application/json` \
and the request message as the body; a `200` answer carries the response message. \
(`application/proto` bodies work too, with the binary encoding, and so do gRPC and gRPC-Web \
on the same port.)
- RPCs without side effects can also be called with `GET` and the query \
`?connect=v1&encoding=json&message=<URL-encoded request JSON>`, which caches well.
- Any other status carries a Connect error: `{\"code\": ..., \"message\": ..., \"details\": [...]}`, \
with the HTTP status derived from the code (for example `unauthenticated` is 401, \
`not_found` 404, `unavailable` 503).
- Messages use the canonical proto3 JSON mapping: lowerCamelCase field names (the proto names \
are accepted too), absent fields left out, 64-bit integers as decimal strings, enums by name, \
`bytes` as base64, `google.protobuf.Timestamp` as an RFC 3339 string, `google.protobuf.Struct` \
as a JSON object and `google.protobuf.Empty` as `{}`.
- Send the API token as `Authorization: Bearer <token>`. `Register` is the exception: agents \
authenticate it with a join token or their client certificate.
- `x-otterscale-feature` names the feature switch an operation belongs to (the \
`(otterscale.api.feature)` option of the RPC).",
    );
    if !streaming.is_empty() {
        text.push_str(&format!(
            "\n\nStreaming RPCs are not listed, because OpenAPI cannot describe Connect's \
enveloped streams: {}. Call them with a Connect, gRPC or gRPC-Web client (for example the \
TypeScript package generated from the same protos).",
            streaming.join(", ")
        ));
    }
    text
}

fn tag(service: &ServiceDescriptor) -> Node {
    let mut tag = Node::map().with("name", service.name());
    // Services carry their description in the comment at the top of the file.
    let text = comment(&service.parent_file(), service.path())
        .or_else(|| comment(&service.parent_file(), &[12]));
    if let Some(text) = text {
        tag.set("description", text);
    }
    tag
}

fn no_side_effects(method: &MethodDescriptor) -> bool {
    method
        .method_descriptor_proto()
        .options
        .as_ref()
        .is_some_and(|o| {
            o.idempotency_level()
                == prost_reflect::prost_types::method_options::IdempotencyLevel::NoSideEffects
        })
}

/// The `name` of the method's `(otterscale.api.feature)` option, if set.
fn feature(method: &MethodDescriptor) -> Option<String> {
    let ext = method
        .parent_pool()
        .get_extension_by_name(FEATURE_EXTENSION)?;
    let options = method.options();
    if !options.has_extension(&ext) {
        return None;
    }
    let value = options.get_extension(&ext);
    let Value::Message(feature) = value.as_ref() else {
        return None;
    };
    feature
        .get_field_by_name("name")
        .and_then(|v| v.as_str().map(str::to_owned))
}

/// The comment attached to the element at `path` of `file`: its leading
/// comment, else its trailing one, with the comment markers' space removed.
pub fn comment(file: &FileDescriptor, path: &[i32]) -> Option<String> {
    let info = file.file_descriptor_proto().source_code_info.as_ref()?;
    let location = info.location.iter().find(|l| l.path == path)?;
    let raw = location
        .leading_comments
        .as_deref()
        .filter(|c| !c.trim().is_empty())
        .or(location.trailing_comments.as_deref())?;
    let text = raw
        .lines()
        .map(|l| l.strip_prefix(' ').unwrap_or(l).trim_end())
        .collect::<Vec<_>>()
        .join("\n");
    let text = text.trim_matches('\n').to_owned();
    (!text.is_empty()).then_some(text)
}

fn schema_ref(name: &str) -> Node {
    Node::map().with("$ref", format!("{SCHEMA_PREFIX}{name}"))
}

/// Builds operations and collects the schemas they reach.
struct Generator<'a> {
    pool: &'a DescriptorPool,
    /// Schemas done, by component name (sorted, so the output is stable).
    done: BTreeMap<String, Node>,
    /// Messages and enums referenced but not yet described.
    pending: Vec<Pending>,
    seen: HashSet<String>,
}

enum Pending {
    Message(MessageDescriptor),
    Enum(EnumDescriptor),
}

impl<'a> Generator<'a> {
    fn new(pool: &'a DescriptorPool) -> Self {
        Generator {
            pool,
            done: BTreeMap::new(),
            pending: Vec::new(),
            seen: HashSet::new(),
        }
    }

    fn operation(&mut self, method: &MethodDescriptor, get: bool) -> Result<Node> {
        let service = method.parent_service();
        let full = format!("{}.{}", service.full_name(), method.name());
        let input = self.message_ref(&method.input());
        let output = self.message_ref(&method.output());

        let mut op = Node::map()
            .with("tags", vec![Node::from(service.name())])
            .with("summary", format!("{}.{}", service.name(), method.name()))
            .with(
                "operationId",
                if get {
                    format!("{full}.get")
                } else {
                    full.clone()
                },
            );
        if let Some(text) = comment(&method.parent_file(), method.path()) {
            op.set("description", text);
        }
        if get {
            op.set(
                "parameters",
                vec![
                    param_ref("connect-query"),
                    param_ref("encoding-query"),
                    Node::map()
                        .with("name", "message")
                        .with("in", "query")
                        .with("required", true)
                        .with(
                            "description",
                            format!("The `{}` message as JSON.", method.input().full_name()),
                        )
                        .with(
                            "content",
                            Node::map().with(
                                "application/json",
                                Node::map().with("schema", input.clone()),
                            ),
                        ),
                ],
            );
        } else {
            op.set("parameters", vec![param_ref("connect-protocol-version")]);
            op.set(
                "requestBody",
                Node::map()
                    .with("required", true)
                    .with("content", json_content(input)),
            );
        }
        op.set(
            "responses",
            Node::map()
                .with(
                    "200",
                    Node::map()
                        .with(
                            "description",
                            format!("The `{}` message.", method.output().full_name()),
                        )
                        .with("content", json_content(output)),
                )
                .with(
                    "default",
                    Node::map().with("$ref", "#/components/responses/connect.Error"),
                ),
        );
        if PUBLIC_METHODS.contains(&full.as_str()) {
            op.set("security", Node::Seq(vec![]));
        }
        if let Some(name) = feature(method) {
            op.set("x-otterscale-feature", name);
        }
        Ok(op)
    }

    fn message_ref(&mut self, msg: &MessageDescriptor) -> Node {
        let name = msg.full_name().to_owned();
        if self.seen.insert(name.clone()) {
            self.pending.push(Pending::Message(msg.clone()));
        }
        schema_ref(&name)
    }

    fn enum_ref(&mut self, e: &EnumDescriptor) -> Node {
        let name = e.full_name().to_owned();
        if self.seen.insert(name.clone()) {
            self.pending.push(Pending::Enum(e.clone()));
        }
        schema_ref(&name)
    }

    /// Describes everything referenced so far (and what that references) and
    /// returns the `components.schemas` map.
    fn finish(mut self) -> Result<Node> {
        while let Some(next) = self.pending.pop() {
            let (name, schema) = match next {
                Pending::Message(m) => (m.full_name().to_owned(), self.message_schema(&m)?),
                Pending::Enum(e) => (e.full_name().to_owned(), enum_schema(&e)),
            };
            self.done.insert(name, schema);
        }
        self.done.insert(ERROR_SCHEMA.to_owned(), error_schema());
        self.done
            .insert("connect.ErrorDetail".to_owned(), error_detail_schema());
        let mut schemas = Node::map();
        for (name, schema) in self.done {
            schemas.set(name, schema);
        }
        Ok(schemas)
    }

    fn message_schema(&mut self, msg: &MessageDescriptor) -> Result<Node> {
        if let Some(schema) = self.well_known(msg)? {
            return Ok(schema);
        }
        let mut schema = Node::map().with("type", "object");
        if let Some(text) = comment(&msg.parent_file(), msg.path()) {
            schema.set("description", text);
        }
        let mut properties = Node::map();
        for field in msg.fields() {
            let mut prop = self.field_schema(&field)?;
            if let Some(text) = comment(&field.parent_file(), field.path()) {
                prop.set("description", text);
            }
            properties.set(field.json_name(), prop);
        }
        if msg.fields().len() > 0 {
            schema.set("properties", properties);
        }
        schema.set("additionalProperties", false);

        // Members of a real oneof exclude each other.
        let mut exclusive = Vec::new();
        for oneof in msg.oneofs().filter(|o| !o.is_synthetic()) {
            let names: Vec<String> = oneof.fields().map(|f| f.json_name().to_owned()).collect();
            for (i, a) in names.iter().enumerate() {
                for b in &names[i + 1..] {
                    exclusive.push(
                        Node::map()
                            .with("required", vec![Node::from(a.as_str()), b.as_str().into()]),
                    );
                }
            }
        }
        if !exclusive.is_empty() {
            schema.set("not", Node::map().with("anyOf", exclusive));
        }
        Ok(schema)
    }

    fn field_schema(&mut self, field: &FieldDescriptor) -> Result<Node> {
        if field.is_map() {
            let Kind::Message(entry) = field.kind() else {
                bail!("map field {} without an entry message", field.full_name());
            };
            let key = entry.map_entry_key_field();
            let value = entry.map_entry_value_field();
            let mut schema = Node::map()
                .with("type", "object")
                .with("additionalProperties", self.kind_schema(&value.kind())?);
            match key.kind() {
                Kind::Bool => {
                    schema.set(
                        "propertyNames",
                        Node::map().with("enum", vec![Node::from("true"), "false".into()]),
                    );
                }
                Kind::String => {}
                Kind::Uint32 | Kind::Fixed32 | Kind::Uint64 | Kind::Fixed64 => {
                    schema.set("propertyNames", Node::map().with("pattern", UINT64_PATTERN));
                }
                _ => {
                    schema.set("propertyNames", Node::map().with("pattern", INT64_PATTERN));
                }
            }
            return Ok(schema);
        }
        let single = self.kind_schema(&field.kind())?;
        if field.is_list() {
            return Ok(Node::map().with("type", "array").with("items", single));
        }
        Ok(single)
    }

    fn kind_schema(&mut self, kind: &Kind) -> Result<Node> {
        Ok(match kind {
            Kind::Double | Kind::Float => {
                let format = if matches!(kind, Kind::Double) {
                    "double"
                } else {
                    "float"
                };
                Node::map().with(
                    "oneOf",
                    vec![
                        Node::map().with("type", "number").with("format", format),
                        Node::map().with(
                            "enum",
                            vec![Node::from("NaN"), "Infinity".into(), "-Infinity".into()],
                        ),
                    ],
                )
            }
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Node::map()
                .with("type", "integer")
                .with("format", "int32")
                .with("minimum", i64::from(i32::MIN))
                .with("maximum", i64::from(i32::MAX)),
            Kind::Uint32 | Kind::Fixed32 => Node::map()
                .with("type", "integer")
                .with("minimum", 0i64)
                .with("maximum", i64::from(u32::MAX)),
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Node::map()
                .with("type", "string")
                .with("format", "int64")
                .with("pattern", INT64_PATTERN),
            Kind::Uint64 | Kind::Fixed64 => Node::map()
                .with("type", "string")
                .with("pattern", UINT64_PATTERN),
            Kind::Bool => Node::map().with("type", "boolean"),
            Kind::String => Node::map().with("type", "string"),
            Kind::Bytes => Node::map()
                .with("type", "string")
                .with("contentEncoding", "base64")
                .with("pattern", BASE64_PATTERN),
            Kind::Message(m) => self.message_ref(m),
            Kind::Enum(e) if e.full_name() == "google.protobuf.NullValue" => {
                Node::map().with("type", "null")
            }
            Kind::Enum(e) => self.enum_ref(e),
        })
    }

    /// Schemas of the well-known types whose JSON form is not an object of
    /// their fields; `None` for every other message.
    fn well_known(&mut self, msg: &MessageDescriptor) -> Result<Option<Node>> {
        let Some(name) = msg.full_name().strip_prefix("google.protobuf.") else {
            return Ok(None);
        };
        let schema = match name {
            "Timestamp" => Node::map()
                .with("type", "string")
                .with("format", "date-time")
                .with(
                    "description",
                    "RFC 3339 date-time in UTC (`Z`), with 0, 3, 6 or 9 fractional digits.",
                ),
            "Duration" => Node::map()
                .with("type", "string")
                .with("pattern", DURATION_PATTERN)
                .with("description", "Seconds with up to nine fractional digits and an `s` suffix, e.g. `1.5s`."),
            "FieldMask" => Node::map()
                .with("type", "string")
                .with("description", "Comma-separated field paths in lowerCamelCase."),
            "Struct" => Node::map()
                .with("type", "object")
                .with("additionalProperties", self.message_ref(&self.wkt("Value")?))
                .with("description", "Any JSON object."),
            "Value" => Node::map().with("description", "Any JSON value."),
            "ListValue" => Node::map()
                .with("type", "array")
                .with("items", self.message_ref(&self.wkt("Value")?))
                .with("description", "Any JSON array."),
            "Any" => Node::map()
                .with("type", "object")
                .with(
                    "properties",
                    Node::map().with("@type", Node::map().with("type", "string")),
                )
                .with("required", vec![Node::from("@type")])
                .with(
                    "description",
                    "A message of the type named by `@type` (a type URL), with its fields beside `@type`, or its JSON form under `value` for well-known types.",
                ),
            "DoubleValue" | "FloatValue" | "Int64Value" | "UInt64Value" | "Int32Value"
            | "UInt32Value" | "BoolValue" | "StringValue" | "BytesValue" => {
                let inner = msg
                    .get_field_by_name("value")
                    .with_context(|| format!("{} has no value field", msg.full_name()))?;
                self.kind_schema(&inner.kind())?
            }
            _ => return Ok(None),
        };
        Ok(Some(schema))
    }

    fn wkt(&self, name: &str) -> Result<MessageDescriptor> {
        self.pool
            .get_message_by_name(&format!("google.protobuf.{name}"))
            .with_context(|| format!("google.protobuf.{name} is not in the descriptor set"))
    }
}

fn enum_schema(e: &EnumDescriptor) -> Node {
    let mut values = Vec::new();
    let mut documented = Vec::new();
    for value in e.values() {
        if let Some(c) = comment(&value.parent_file(), value.path()) {
            documented.push(format!("- `{}`: {}", value.name(), c.replace('\n', " ")));
        }
        values.push(Node::from(value.name()));
    }
    let text = [
        comment(&e.parent_file(), e.path()).unwrap_or_default(),
        documented.join("\n"),
    ]
    .into_iter()
    .filter(|t| !t.is_empty())
    .collect::<Vec<_>>()
    .join("\n\n");
    let mut schema = Node::map().with("type", "string").with("enum", values);
    if !text.is_empty() {
        schema.set("description", text);
    }
    schema
}

fn param_ref(name: &str) -> Node {
    Node::map().with("$ref", format!("#/components/parameters/{name}"))
}

fn json_content(schema: Node) -> Node {
    Node::map().with("application/json", Node::map().with("schema", schema))
}

fn parameters() -> Node {
    Node::map()
        .with(
            "connect-protocol-version",
            Node::map()
                .with("name", "Connect-Protocol-Version")
                .with("in", "header")
                .with("required", false)
                .with(
                    "description",
                    "Connect protocol version; clients should send `1`.",
                )
                .with(
                    "schema",
                    Node::map()
                        .with("type", "string")
                        .with("enum", vec![Node::from("1")]),
                ),
        )
        .with(
            "connect-query",
            Node::map()
                .with("name", "connect")
                .with("in", "query")
                .with("required", true)
                .with("description", "Connect protocol version of a GET request.")
                .with(
                    "schema",
                    Node::map()
                        .with("type", "string")
                        .with("enum", vec![Node::from("v1")]),
                ),
        )
        .with(
            "encoding-query",
            Node::map()
                .with("name", "encoding")
                .with("in", "query")
                .with("required", true)
                .with("description", "Codec of `message`.")
                .with(
                    "schema",
                    Node::map()
                        .with("type", "string")
                        .with("enum", vec![Node::from("json")]),
                ),
        )
}

fn responses() -> Node {
    Node::map().with(
        "connect.Error",
        Node::map()
            .with(
                "description",
                "A Connect error; the HTTP status follows from `code`.",
            )
            .with("content", json_content(schema_ref(ERROR_SCHEMA))),
    )
}

fn error_schema() -> Node {
    Node::map()
        .with("type", "object")
        .with("description", "The body of every Connect error response.")
        .with(
            "properties",
            Node::map()
                .with(
                    "code",
                    Node::map()
                        .with("type", "string")
                        .with(
                            "enum",
                            CONNECT_CODES
                                .iter()
                                .map(|c| Node::from(*c))
                                .collect::<Vec<_>>(),
                        )
                        .with(
                            "description",
                            "The Connect (gRPC) status code in snake_case.",
                        ),
                )
                .with(
                    "message",
                    Node::map()
                        .with("type", "string")
                        .with("description", "For a person to read."),
                )
                .with(
                    "details",
                    Node::map()
                        .with("type", "array")
                        .with("items", schema_ref("connect.ErrorDetail")),
                ),
        )
        .with("required", vec![Node::from("code")])
}

fn error_detail_schema() -> Node {
    Node::map()
        .with("type", "object")
        .with("description", "A protobuf message attached to an error.")
        .with(
            "properties",
            Node::map()
                .with(
                    "type",
                    Node::map().with("type", "string").with(
                        "description",
                        "Full name of the message type, e.g. `google.rpc.RetryInfo`.",
                    ),
                )
                .with(
                    "value",
                    Node::map()
                        .with("type", "string")
                        .with("contentEncoding", "base64")
                        .with("description", "The message in the binary encoding, base64 (padding optional)."),
                )
                .with(
                    "debug",
                    Node::map().with(
                        "description",
                        "The message as JSON, when the server adds it for people reading the error.",
                    ),
                ),
        )
        .with(
            "required",
            vec![Node::from("type"), "value".into()],
        )
}

fn security_schemes() -> Node {
    Node::map().with(
        SECURITY_SCHEME,
        Node::map()
            .with("type", "http")
            .with("scheme", "bearer")
            .with(
                "description",
                "An API token of the hub, e.g. the admin token the hub writes to `<data dir>/admin-token` on first start.",
            ),
    )
}
