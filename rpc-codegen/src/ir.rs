//! The service IR: what both front ends (`.proto` through prost-build, Rust traits through
//! `#[service]`) produce and the one emitter consumes.

use std::collections::HashMap;
use std::fmt;

use heck::{ToShoutySnakeCase, ToUpperCamelCase};

/// A service: a named set of methods, served under `/package.Service/Method` paths.
#[derive(Clone, Debug)]
pub struct ServiceDef {
    /// The Rust name of the service trait (`Greeter`). Module and type names derive from it:
    /// `greeter_server::{Greeter, GreeterServer}`, `greeter_client::GreeterClient`.
    pub name: String,
    /// The service name as it appears in the `.proto` file (or the trait name), used in method
    /// paths.
    pub proto_name: String,
    /// The protobuf package (`helloworld`); empty for none.
    pub package: String,
    /// The methods, in declaration order.
    pub methods: Vec<MethodDef>,
    /// Doc lines (each becomes one `///` line; a leading space is kept as written).
    pub docs: Vec<String>,
}

/// One rpc of a service.
#[derive(Clone, Debug)]
pub struct MethodDef {
    /// The Rust method name in `snake_case`. Rust keywords are raw identifiers (`r#type`), as
    /// prost names fields; `self`, `super`, `crate`, `Self`, `extern` and `_` cannot be raw and
    /// carry a `_` suffix instead (`self_`).
    pub name: String,
    /// The method name as it appears in the `.proto` file (`SayHello`), used in the path.
    pub proto_name: String,
    /// The request message type, written as seen from the module the generated modules are
    /// placed in (prost's convention: `HelloRequest`, `super::common::Empty`, `::prost_types::Timestamp`,
    /// `()`). The emitter re-bases relative paths with one more `super::`.
    pub input_type: syn::Type,
    /// The response message type, written like [`MethodDef::input_type`].
    pub output_type: syn::Type,
    /// Whether the client sends a stream of requests.
    pub client_streaming: bool,
    /// Whether the server sends a stream of responses.
    pub server_streaming: bool,
    /// Doc lines, as [`ServiceDef::docs`].
    pub docs: Vec<String>,
    /// Whether the method is deprecated (`option deprecated = true;`): client methods get
    /// `#[deprecated]`.
    pub deprecated: bool,
    /// What running the method twice does (`option idempotency_level = ...;`, or
    /// `#[rpc(idempotent)]` / `#[rpc(no_side_effects)]` in `#[service]`): the emitted
    /// `MethodDesc` carries it, and clients retry calls of idempotent methods that may have
    /// executed (see `rpc_core::RetryPolicy`).
    pub idempotency: Idempotency,
}

/// A method's declared idempotency, protobuf's `MethodOptions.IdempotencyLevel`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Idempotency {
    /// Not declared (`IDEMPOTENCY_UNKNOWN`).
    #[default]
    Unknown,
    /// `IDEMPOTENT`: running it twice has the effect of running it once.
    Idempotent,
    /// `NO_SIDE_EFFECTS`: it changes nothing.
    NoSideEffects,
}

impl Idempotency {
    /// The variant's name in `rpc_core::codegen::Idempotency`.
    pub fn variant(self) -> &'static str {
        match self {
            Idempotency::Unknown => "Unknown",
            Idempotency::Idempotent => "Idempotent",
            Idempotency::NoSideEffects => "NoSideEffects",
        }
    }
}

/// The four call kinds of gRPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    /// One request, one response.
    Unary,
    /// One request, a stream of responses.
    ServerStreaming,
    /// A stream of requests, one response.
    ClientStreaming,
    /// Streams both ways.
    Streaming,
}

impl CallKind {
    /// The variant's name in `rpc_core::codegen::CallKind`.
    pub fn variant(self) -> &'static str {
        match self {
            CallKind::Unary => "Unary",
            CallKind::ServerStreaming => "ServerStreaming",
            CallKind::ClientStreaming => "ClientStreaming",
            CallKind::Streaming => "Streaming",
        }
    }
}

/// Method names the generated clients use for their own associated functions (the
/// constructors `new`, `connect` and `with_interceptor`, as tonic's clients do). Everything else the generated code
/// defines lives in its own namespace: blocking calls and pipelines on their own client types,
/// the method list as an associated constant of the server type.
pub const RESERVED_METHOD_NAMES: &[&str] = &["new", "connect", "with_interceptor"];

/// A problem found in a [`ServiceDef`] before emitting it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodegenError {
    /// The fully qualified service name (`helloworld.Greeter`).
    pub service: String,
    /// The index of the offending method in [`ServiceDef::methods`], if the problem is a
    /// method's.
    pub method: Option<usize>,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl fmt::Display for CodegenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "service `{}`: {}", self.service, self.message)
    }
}

impl std::error::Error for CodegenError {}

impl ServiceDef {
    /// The fully qualified service name: `package.Service`, or `Service` without a package.
    pub fn full_name(&self) -> String {
        if self.package.is_empty() {
            self.proto_name.clone()
        } else {
            format!("{}.{}", self.package, self.proto_name)
        }
    }

    /// The path of `method`: `/package.Service/Method`.
    pub fn method_path(&self, method: &MethodDef) -> String {
        format!("/{}/{}", self.full_name(), method.proto_name)
    }

    /// Name of the generated server module (`greeter_server`), spelt as tonic-build spells it:
    /// `_` before every upper-case letter but the first, then lower case (`Self_` gives
    /// `self__server`, `HTTPProxy` gives `h_t_t_p_proxy_server`).
    pub fn server_mod(&self) -> String {
        format!("{}_server", tonic_snake_case(&self.name))
    }

    /// Name of the generated client module (`greeter_client`), spelt like
    /// [`ServiceDef::server_mod`].
    pub fn client_mod(&self) -> String {
        format!("{}_client", tonic_snake_case(&self.name))
    }

    /// Name of the module `emit_tonic` wraps tonic's code in (`greeter_tonic`), spelt like
    /// [`ServiceDef::server_mod`].
    pub fn tonic_mod(&self) -> String {
        format!("{}_tonic", tonic_snake_case(&self.name))
    }

    /// Name of the generated server type (`GreeterServer`).
    pub fn server_type(&self) -> String {
        format!("{}Server", self.name)
    }

    /// Name of the generated client type (`GreeterClient`): tonic's async methods.
    pub fn client_type(&self) -> String {
        format!("{}Client", self.name)
    }

    /// Name of the generated blocking client type (`GreeterBlockingClient`): one blocking
    /// method per unary method, under the method's own name.
    pub fn blocking_client_type(&self) -> String {
        format!("{}BlockingClient", self.name)
    }

    /// Name of the generated pipeline client type (`GreeterPipelineClient`): one method per
    /// unary method, under the method's own name, opening a pipeline of that method.
    pub fn pipeline_client_type(&self) -> String {
        format!("{}PipelineClient", self.name)
    }

    /// The name of the server type's type parameter: `T`, or `S` for a service named `T`.
    pub fn type_param(&self) -> &'static str {
        if self.name == "T" { "S" } else { "T" }
    }

    /// Checks what the emitter relies on: valid identifiers, no name the generated code already
    /// uses, no two methods with the same name, path or method id. All problems are reported,
    /// not only the first.
    ///
    /// # Errors
    /// Every problem found.
    pub fn validate(&self) -> Result<(), Vec<CodegenError>> {
        let mut errors = Vec::new();
        let service = self.full_name();
        let mut err = |method: Option<usize>, message: String| {
            errors.push(CodegenError {
                service: service.clone(),
                method,
                message,
            });
        };

        if !is_ident(&self.name) || !is_ident(&self.server_mod()) || !is_ident(&self.client_mod()) {
            err(
                None,
                format!(
                    "the service name `{}` is not a valid Rust type name (or its module names \
                     `{}`/`{}` are not valid identifiers)",
                    self.name,
                    self.server_mod(),
                    self.client_mod()
                ),
            );
        }

        let mut names: HashMap<String, usize> = HashMap::new();
        let mut paths: HashMap<String, usize> = HashMap::new();
        let mut ids: HashMap<u32, usize> = HashMap::new();
        let mut streams: HashMap<String, usize> = HashMap::new();
        let mut consts: HashMap<String, usize> = HashMap::new();

        for (i, m) in self.methods.iter().enumerate() {
            let plain = m.plain_name();
            if syn::parse_str::<syn::Ident>(&m.name).is_err()
                && syn::parse_str::<syn::Ident>(&format!("r#{plain}")).is_err()
            {
                err(
                    Some(i),
                    format!("method name `{}` is not a valid Rust identifier", m.name),
                );
                continue;
            }
            let mut derived = vec![m.const_name()];
            if m.server_streaming {
                derived.push(m.stream_type());
            }
            if let Some(bad) = derived.iter().find(|d| !is_ident(d)) {
                err(
                    Some(i),
                    format!(
                        "method name `{}` gives the generated name `{bad}`, which is not a valid \
                         Rust identifier; rename the method",
                        m.name
                    ),
                );
                continue;
            }
            if RESERVED_METHOD_NAMES.contains(&plain) {
                err(
                    Some(i),
                    format!(
                        "method name `{plain}` is reserved: the generated client defines \
                         `{plain}` (its constructor, as tonic's clients do); rename the method"
                    ),
                );
            }
            if let Some(&j) = names.get(plain) {
                err(
                    Some(i),
                    format!(
                        "methods `{}` and `{}` both map to the Rust name `{plain}`",
                        self.methods[j].proto_name, m.proto_name
                    ),
                );
            } else {
                names.insert(plain.to_owned(), i);
            }
            if let Some(&j) = consts.get(&m.const_name()) {
                if self.methods[j].plain_name() != plain {
                    err(
                        Some(i),
                        format!(
                            "methods `{}` and `{}` both map to the constant `{}`",
                            self.methods[j].name,
                            m.name,
                            m.const_name()
                        ),
                    );
                }
            } else {
                consts.insert(m.const_name(), i);
            }
            let path = self.method_path(m);
            match paths.get(&path) {
                Some(&j) => err(
                    Some(i),
                    format!(
                        "methods `{}` and `{}` have the same path `{path}`; method names must be \
                         unique",
                        self.methods[j].name, m.name
                    ),
                ),
                None => {
                    paths.insert(path.clone(), i);
                    let id = method_id(&path);
                    if let Some(&j) = ids.get(&id) {
                        err(
                            Some(i),
                            format!(
                                "method ids collide: `{}` and `{path}` both hash to {id:#010x} \
                                 (FNV-1a of the path); rename one of the methods",
                                self.method_path(&self.methods[j])
                            ),
                        );
                    } else {
                        ids.insert(id, i);
                    }
                }
            }
            if m.server_streaming {
                let s = m.stream_type();
                if let Some(&j) = streams.get(&s) {
                    err(
                        Some(i),
                        format!(
                            "server-streaming methods `{}` and `{}` both need the associated \
                             type `{s}`; rename one of them",
                            self.methods[j].name, m.name
                        ),
                    );
                } else {
                    streams.insert(s, i);
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

impl MethodDef {
    /// The call kind.
    pub fn kind(&self) -> CallKind {
        match (self.client_streaming, self.server_streaming) {
            (false, false) => CallKind::Unary,
            (false, true) => CallKind::ServerStreaming,
            (true, false) => CallKind::ClientStreaming,
            (true, true) => CallKind::Streaming,
        }
    }

    /// The name without a raw-identifier prefix (`type` for `r#type`).
    pub fn plain_name(&self) -> &str {
        self.name.strip_prefix("r#").unwrap_or(&self.name)
    }

    /// The name of the method's descriptor constant (`SAY_HELLO`).
    pub fn const_name(&self) -> String {
        self.plain_name().to_shouty_snake_case()
    }

    /// The name of the server trait's associated stream type (`ListFeaturesStream`).
    pub fn stream_type(&self) -> String {
        format!("{}Stream", self.plain_name().to_upper_camel_case())
    }
}

/// tonic-build's snake case for module names: `_` before each upper-case letter that follows
/// another character, then everything in lower case. Unlike heck's, it keeps underscores and
/// splits acronyms letter by letter, so that our modules are named as tonic's are.
pub fn tonic_snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c.to_ascii_lowercase());
        if chars.peek().is_some_and(|next| next.is_uppercase()) {
            out.push('_');
        }
    }
    out
}

fn is_ident(s: &str) -> bool {
    syn::parse_str::<syn::Ident>(s).is_ok()
}

/// The stable id of a method path: 32-bit FNV-1a of its UTF-8 bytes, 0 mapped to 1. The same
/// function as `rpc_core::method::method_id`, evaluated at code generation time to detect
/// collisions.
pub const fn method_id(path: &str) -> u32 {
    let b = path.as_bytes();
    let mut h: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < b.len() {
        h ^= b[i] as u32;
        h = h.wrapping_mul(0x0100_0193);
        i += 1;
    }
    if h == 0 { 1 } else { h }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method(name: &str, proto: &str) -> MethodDef {
        MethodDef {
            name: name.into(),
            proto_name: proto.into(),
            input_type: syn::parse_quote!(Req),
            output_type: syn::parse_quote!(Resp),
            client_streaming: false,
            server_streaming: false,
            docs: vec![],
            deprecated: false,
            idempotency: Idempotency::Unknown,
        }
    }

    fn service(methods: Vec<MethodDef>) -> ServiceDef {
        ServiceDef {
            name: "Greeter".into(),
            proto_name: "Greeter".into(),
            package: "helloworld".into(),
            methods,
            docs: vec![],
        }
    }

    #[test]
    fn method_id_matches_reference_fnv1a() {
        assert_eq!(method_id("a"), 0xe40c_292c);
        assert_eq!(method_id("foobar"), 0xbf9c_f968);
        assert_eq!(method_id(""), 0x811c_9dc5);
    }

    #[test]
    fn names_derive_from_the_service_and_method() {
        let s = service(vec![method("r#type", "type")]);
        assert_eq!(s.full_name(), "helloworld.Greeter");
        assert_eq!(s.server_mod(), "greeter_server");
        assert_eq!(s.client_type(), "GreeterClient");
        let m = &s.methods[0];
        assert_eq!(m.plain_name(), "type");
        assert_eq!(m.const_name(), "TYPE");
        assert_eq!(m.stream_type(), "TypeStream");
        assert_eq!(s.method_path(m), "/helloworld.Greeter/type");
        let mut s = s;
        s.package.clear();
        assert_eq!(s.method_path(&s.methods[0]), "/Greeter/type");
    }

    #[test]
    fn a_valid_service_passes() {
        let s = service(vec![
            method("say_hello", "SayHello"),
            method("r#type", "type"),
        ]);
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn every_problem_is_reported() {
        let s = service(vec![
            method("say_hello", "SayHello"),
            method("say_hello", "say_hello"),
            method("connect", "Connect"),
            method("new", "New"),
        ]);
        let errors = s.validate().unwrap_err();
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 3, "{text:#?}");
        assert!(text[0].contains("both map to the Rust name `say_hello`"));
        assert_eq!(errors[0].method, Some(1));
        assert!(text[1].contains("`connect` is reserved"));
        assert!(text[2].contains("`new` is reserved"));
    }

    #[test]
    fn runtime_names_and_derived_names_are_free() {
        // Everything tonic accepts: services and methods named like runtime items, and methods
        // named like another method's blocking or pipeline entry point in other schemes.
        for name in [
            "Status", "Pipeline", "Message", "Metadata", "Channel", "Service", "T",
        ] {
            let mut s = service(vec![
                method("run", "Run"),
                method("run_pipeline", "RunPipeline"),
                method("read", "Read"),
                method("read_blocking", "ReadBlocking"),
                method("channel", "Channel"),
                method("methods", "Methods"),
                method("status", "Status"),
            ]);
            s.name = name.into();
            assert_eq!(s.validate(), Ok(()), "{name}");
        }
    }

    #[test]
    fn module_names_are_tonics() {
        for (service, module) in [
            ("Greeter", "greeter_server"),
            ("Self_", "self__server"),
            ("HTTPProxy", "h_t_t_p_proxy_server"),
            ("RouteGuide", "route_guide_server"),
            ("V2Api", "v2_api_server"),
        ] {
            let mut s = service_named(service);
            s.name = service.into();
            assert_eq!(s.server_mod(), module);
        }
        assert_eq!(service_named("Self_").tonic_mod(), "self__tonic");
        assert_eq!(service_named("T").type_param(), "S");
        assert_eq!(service_named("Greeter").type_param(), "T");
    }

    fn service_named(name: &str) -> ServiceDef {
        let mut s = service(vec![]);
        s.name = name.into();
        s
    }

    #[test]
    fn duplicate_paths_and_stream_types_are_refused() {
        let mut a = method("list_a", "ListA");
        a.server_streaming = true;
        let mut b = method("list__a", "List_A");
        b.server_streaming = true;
        let s = service(vec![a, b, method("x", "ListA")]);
        let errors = s.validate().unwrap_err();
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert!(
            text.iter()
                .any(|t| t.contains("associated type `ListAStream`")),
            "{text:#?}"
        );
        assert!(text.iter().any(|t| t.contains("same path")), "{text:#?}");
    }

    #[test]
    fn id_collisions_are_detected() {
        // `/p.S/M794331` and `/p.S/M1219000` both hash to 0x43c8856c (found by brute force).
        let (x, y) = ("M794331", "M1219000");
        assert_eq!(method_id("/p.S/M794331"), 0x43c8856c);
        assert_eq!(method_id("/p.S/M1219000"), 0x43c8856c);
        let s = ServiceDef {
            name: "S".into(),
            proto_name: "S".into(),
            package: "p".into(),
            methods: vec![method(&x.to_lowercase(), x), method(&y.to_lowercase(), y)],
            docs: vec![],
        };
        let errors = s.validate().unwrap_err();
        assert_eq!(errors.len(), 1);
        assert!(errors[0].message.contains("method ids collide"));
        assert_eq!(errors[0].method, Some(1));
    }
}
