//! The `.proto` front end: protox compiles the files (no `protoc`), prost-build generates the
//! messages, and [`ServiceGenerator`] maps each `prost_build::Service` to the IR and emits it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use proc_macro2::TokenStream;
use quote::quote;

use crate::docs::doc_lines;
use crate::emit::{EmitOptions, generate, pretty};
use crate::error::{Error, Location, Problem};
use crate::ir::{CodegenError, Idempotency, MethodDef, ServiceDef};

/// A builder for `build.rs` in the spirit of tonic-build: configure, then
/// [`compile`](Builder::compile).
///
/// ```no_run
/// // build.rs
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     rpc_codegen::configure()
///         .bytes(["."])
///         .compile(&["proto/greeter.proto"], &["proto"])?;
///     Ok(())
/// }
/// ```
///
/// and in the crate:
///
/// ```ignore
/// pub mod helloworld {
///     include!(concat!(env!("OUT_DIR"), "/helloworld.rs"));
/// }
/// ```
///
/// The crate needs `prost` (and `prost-types` for well-known types) and `rpc-core` as
/// dependencies; with `Builder::emit_tonic` (feature `tonic`) also `tonic` and `tonic-prost`.
#[derive(Clone, Debug)]
pub struct Builder {
    build_client: bool,
    build_server: bool,
    crate_path: String,
    out_dir: Option<PathBuf>,
    extern_path: Vec<(String, String)>,
    type_attributes: Vec<(String, String)>,
    message_attributes: Vec<(String, String)>,
    enum_attributes: Vec<(String, String)>,
    field_attributes: Vec<(String, String)>,
    boxed: Vec<String>,
    btree_map: Vec<String>,
    bytes: Vec<String>,
    include_file: Option<PathBuf>,
    file_descriptor_set_path: Option<PathBuf>,
    emit_rerun_if_changed: bool,
    #[cfg(feature = "tonic")]
    emit_tonic: bool,
}

/// A [`Builder`] with defaults: client and server, runtime at `::rpc_core`, output in
/// `$OUT_DIR`, `cargo:rerun-if-changed` emitted when run by a build script.
pub fn configure() -> Builder {
    Builder {
        build_client: true,
        build_server: true,
        crate_path: "::rpc_core".to_owned(),
        out_dir: None,
        extern_path: Vec::new(),
        type_attributes: Vec::new(),
        message_attributes: Vec::new(),
        enum_attributes: Vec::new(),
        field_attributes: Vec::new(),
        boxed: Vec::new(),
        btree_map: Vec::new(),
        bytes: Vec::new(),
        include_file: None,
        file_descriptor_set_path: None,
        // Build scripts run with OUT_DIR set; tests and tools do not.
        emit_rerun_if_changed: std::env::var_os("OUT_DIR").is_some(),
        #[cfg(feature = "tonic")]
        emit_tonic: false,
    }
}

/// Compiles `protos` (found under `includes`) with the default [`Builder`].
///
/// # Errors
/// As [`Builder::compile`].
pub fn compile_protos(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    configure().compile(protos, includes)
}

impl Builder {
    /// Whether to emit the `<service>_client` modules (default true).
    pub fn build_client(mut self, enable: bool) -> Self {
        self.build_client = enable;
        self
    }

    /// Whether to emit the `<service>_server` modules (default true).
    pub fn build_server(mut self, enable: bool) -> Self {
        self.build_server = enable;
        self
    }

    /// The path generated code uses for the runtime crate (default `::rpc_core`), for crates that
    /// re-export it: `crate_path("::my_reexport::rpc_core")`.
    pub fn crate_path(mut self, path: impl AsRef<str>) -> Self {
        self.crate_path = path.as_ref().to_owned();
        self
    }

    /// Where to write the generated files (default `$OUT_DIR`).
    pub fn out_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.out_dir = Some(dir.as_ref().to_owned());
        self
    }

    /// Uses an existing Rust type for a protobuf path (prost's `extern_path`), e.g.
    /// `extern_path(".common", "::common_protos")`.
    pub fn extern_path(mut self, proto_path: impl AsRef<str>, rust_path: impl AsRef<str>) -> Self {
        self.extern_path.push((
            proto_path.as_ref().to_owned(),
            rust_path.as_ref().to_owned(),
        ));
        self
    }

    /// Adds an attribute to matched messages, enums and oneofs (prost's `type_attribute`).
    pub fn type_attribute(mut self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.type_attributes
            .push((path.as_ref().to_owned(), attribute.as_ref().to_owned()));
        self
    }

    /// Adds an attribute to matched messages (prost's `message_attribute`).
    pub fn message_attribute(mut self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.message_attributes
            .push((path.as_ref().to_owned(), attribute.as_ref().to_owned()));
        self
    }

    /// Adds an attribute to matched enums (prost's `enum_attribute`).
    pub fn enum_attribute(mut self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.enum_attributes
            .push((path.as_ref().to_owned(), attribute.as_ref().to_owned()));
        self
    }

    /// Adds an attribute to matched fields (prost's `field_attribute`).
    pub fn field_attribute(mut self, path: impl AsRef<str>, attribute: impl AsRef<str>) -> Self {
        self.field_attributes
            .push((path.as_ref().to_owned(), attribute.as_ref().to_owned()));
        self
    }

    /// Boxes matched fields (prost's `boxed`).
    pub fn boxed(mut self, path: impl AsRef<str>) -> Self {
        self.boxed.push(path.as_ref().to_owned());
        self
    }

    /// Generates `BTreeMap` instead of `HashMap` for matched map fields (prost's `btree_map`).
    pub fn btree_map<I, S>(mut self, paths: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.btree_map
            .extend(paths.into_iter().map(|p| p.as_ref().to_owned()));
        self
    }

    /// Generates `bytes::Bytes` instead of `Vec<u8>` for matched `bytes` fields (prost's
    /// `bytes`; `["."]` for all). With `Bytes`, large payloads can be decoded without a copy.
    pub fn bytes<I, S>(mut self, paths: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.bytes
            .extend(paths.into_iter().map(|p| p.as_ref().to_owned()));
        self
    }

    /// Also writes an include file that nests every generated package in modules (prost's
    /// `include_file`).
    pub fn include_file(mut self, path: impl AsRef<Path>) -> Self {
        self.include_file = Some(path.as_ref().to_owned());
        self
    }

    /// Also writes the encoded `FileDescriptorSet` there: every file compiled, its imports
    /// included, with source info (comments). A server registers it for gRPC reflection on
    /// its bootstrap port, as tonic-build's option of the same name is used:
    ///
    /// ```ignore
    /// // build.rs
    /// let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    /// rpc_codegen::configure()
    ///     .file_descriptor_set_path(out.join("descriptors.bin"))
    ///     .compile(&["proto/greeter.proto"], &["proto"])?;
    /// // the server
    /// const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));
    /// Server::builder()
    ///     .add_service(GreeterServer::new(imp))
    ///     .register_file_descriptor_set(DESCRIPTORS)
    /// ```
    pub fn file_descriptor_set_path(mut self, path: impl AsRef<Path>) -> Self {
        self.file_descriptor_set_path = Some(path.as_ref().to_owned());
        self
    }

    /// Whether to print `cargo:rerun-if-changed` for every `.proto` file read, imports
    /// included (default: when run by a build script).
    pub fn emit_rerun_if_changed(mut self, enable: bool) -> Self {
        self.emit_rerun_if_changed = enable;
        self
    }

    /// Also emits tonic's gRPC client and server for every service, in a `<service>_tonic`
    /// module, with a `<Service>TonicAdapter<T>` that serves an implementation of our server
    /// trait over tonic. Needs this crate's `tonic` feature, and `tonic` + `tonic-prost` in the
    /// crate that includes the generated code. See [`crate::tonic`](crate#tonic) for what the
    /// adapter converts.
    #[cfg(feature = "tonic")]
    pub fn emit_tonic(mut self, enable: bool) -> Self {
        self.emit_tonic = enable;
        self
    }

    /// Compiles `protos` with protox (no `protoc` needed), looking up them and their imports
    /// under `includes`, and generates messages and services into the output directory, one
    /// file per package (`helloworld.rs`; `_.rs` for files without a package).
    ///
    /// # Errors
    /// Every problem found, each at its place (`file:line:column`, the line, a caret): what
    /// protox refuses (syntax, unresolved names and imports, duplicate definitions and field
    /// numbers, pointed at the second definition), services that cannot be generated (name
    /// clashes, method id collisions, pointed at the method), and files that cannot be read or
    /// written. See [`Error`].
    pub fn compile(
        self,
        protos: &[impl AsRef<Path>],
        includes: &[impl AsRef<Path>],
    ) -> Result<(), Error> {
        let includes: Vec<PathBuf> = includes.iter().map(|p| p.as_ref().to_owned()).collect();
        let (compiler, read) = load(protos, &includes)?;
        if self.emit_rerun_if_changed {
            for path in &read {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
        if let Some(path) = &self.file_descriptor_set_path {
            std::fs::write(path, compiler.encode_file_descriptor_set())
                .map_err(|e| Error::io(format_args!("writing {}", path.display()), e))?;
        }
        self.generate(
            compiler.file_descriptor_set(),
            prost_build::Config::new(),
            &includes,
        )
    }

    /// Generates code for an already compiled `FileDescriptorSet` (with imports and source
    /// info). Prints no `cargo:rerun-if-changed`.
    ///
    /// # Errors
    /// As [`Builder::compile`] (locations without the source line: the files are not known).
    pub fn compile_fds(self, fds: prost_types::FileDescriptorSet) -> Result<(), Error> {
        self.compile_fds_with_config(fds, prost_build::Config::new())
    }

    /// As [`Builder::compile_fds`], on top of a prost `Config` the caller prepared (its service
    /// generator is replaced).
    ///
    /// # Errors
    /// As [`Builder::compile_fds`].
    pub fn compile_fds_with_config(
        self,
        fds: prost_types::FileDescriptorSet,
        config: prost_build::Config,
    ) -> Result<(), Error> {
        self.generate(fds, config, &[])
    }

    fn generate(
        self,
        fds: prost_types::FileDescriptorSet,
        mut config: prost_build::Config,
        includes: &[PathBuf],
    ) -> Result<(), Error> {
        let crate_path: syn::Path = syn::parse_str(&self.crate_path).map_err(|e| {
            Error::new(vec![Problem::new(format!(
                "crate_path `{}` is not a Rust path: {e}",
                self.crate_path
            ))])
        })?;
        if let Some(dir) = &self.out_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format_args!("creating {}", dir.display()), e))?;
            config.out_dir(dir);
        }
        for (proto, rust) in &self.extern_path {
            config.extern_path(proto, rust);
        }
        for (path, attr) in &self.type_attributes {
            config.type_attribute(path, attr);
        }
        for (path, attr) in &self.message_attributes {
            config.message_attribute(path, attr);
        }
        for (path, attr) in &self.enum_attributes {
            config.enum_attribute(path, attr);
        }
        for (path, attr) in &self.field_attributes {
            config.field_attribute(path, attr);
        }
        for path in &self.boxed {
            config.boxed(path);
        }
        if !self.btree_map.is_empty() {
            config.btree_map(&self.btree_map);
        }
        if !self.bytes.is_empty() {
            config.bytes(&self.bytes);
        }
        if let Some(path) = &self.include_file {
            config.include_file(path);
        }

        let options = EmitOptions {
            crate_path,
            build_client: self.build_client,
            build_server: self.build_server,
            ..EmitOptions::default()
        };
        #[cfg_attr(not(feature = "tonic"), allow(unused_mut))]
        let mut generator = ServiceGenerator::new(options);
        #[cfg(feature = "tonic")]
        if self.emit_tonic {
            generator.tonic = Some(crate::tonic::TonicPart::new(
                self.build_client,
                self.build_server,
            ));
        }
        let errors = generator.errors();
        let places = ServicePlaces::new(&fds);
        config.service_generator(Box::new(generator));
        config
            .compile_fds(fds)
            .map_err(|e| Error::io("generating code (prost-build)", e))?;

        let errors = errors.borrow();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::new(
                errors
                    .iter()
                    .map(|e| Problem::new(e.to_string()).at(places.locate(e, includes)))
                    .collect(),
            ))
        }
    }
}

/// Where each service and method is declared: file and `[line, column, ..]` spans of their
/// names, from the descriptors' source info.
struct ServicePlaces {
    services: HashMap<String, ServicePlace>,
}

struct ServicePlace {
    file: String,
    name: Option<Vec<i32>>,
    methods: Vec<Option<Vec<i32>>>,
}

impl ServicePlaces {
    fn new(fds: &prost_types::FileDescriptorSet) -> Self {
        // Field numbers in descriptor.proto: FileDescriptorProto.service = 6,
        // ServiceDescriptorProto.name = 1 and .method = 2, MethodDescriptorProto.name = 1.
        const SERVICE: i32 = 6;
        const NAME: i32 = 1;
        const METHOD: i32 = 2;
        let mut services = HashMap::new();
        for file in &fds.file {
            let spans: HashMap<&[i32], &Vec<i32>> = file
                .source_code_info
                .iter()
                .flat_map(|info| &info.location)
                .map(|l| (l.path.as_slice(), &l.span))
                .collect();
            let span = |path: &[i32]| spans.get(path).map(|s| (*s).clone());
            for (si, service) in file.service.iter().enumerate() {
                let si = si as i32;
                let full = match file.package() {
                    "" => service.name().to_owned(),
                    package => format!("{package}.{}", service.name()),
                };
                let methods = (0..service.method.len() as i32)
                    .map(|mi| span(&[SERVICE, si, METHOD, mi, NAME]))
                    .collect();
                services.insert(
                    full,
                    ServicePlace {
                        file: file.name().to_owned(),
                        name: span(&[SERVICE, si, NAME]),
                        methods,
                    },
                );
            }
        }
        ServicePlaces { services }
    }

    /// The name of the method `e` is about, or of its service.
    fn locate(&self, e: &CodegenError, includes: &[PathBuf]) -> Option<Location> {
        let place = self.services.get(&e.service)?;
        let (span, what) = match e.method {
            Some(i) => (place.methods.get(i)?.as_ref()?, "this method"),
            None => (place.name.as_ref()?, "this service"),
        };
        let (line, column) = (*span.first()? as usize, *span.get(1)? as usize);
        let end = if span.len() == 3 {
            span[2]
        } else {
            span[1] + 1
        } as usize;
        Some(Location::new(
            &place.file,
            line + 1,
            column + 1,
            end.saturating_sub(column),
            what,
            includes,
        ))
    }
}

/// Compiles `protos` with protox; returns the compiler and every file it read from disk
/// (imports included; protox's built-in `google/protobuf/*.proto` have no path).
fn load(
    protos: &[impl AsRef<Path>],
    includes: &[PathBuf],
) -> Result<(protox::Compiler, Vec<PathBuf>), Error> {
    let mut compiler = protox::Compiler::new(includes)
        .map_err(|e| Error::new(vec![Problem::new(format!("protox: {e}"))]))?;
    compiler.include_imports(true).include_source_info(true);
    for proto in protos {
        compiler
            .open_file(proto.as_ref())
            .map_err(|e| Error::new(protox_problems(&e, includes)))?;
    }
    let read = compiler
        .files()
        .filter_map(|f| f.path().map(Path::to_owned))
        .collect();
    Ok((compiler, read))
}

/// protox's error as problems: the error and the ones related to it, each placed at its
/// offending label (protox lists a duplicate's first definition before the second one).
fn protox_problems(e: &protox::Error, includes: &[PathBuf]) -> Vec<Problem> {
    use miette::Diagnostic;
    let mut problems = vec![diagnostic_problem(e, e.source_code(), e.file(), includes)];
    if let Some(related) = e.related() {
        for r in related {
            let source = r.source_code().or(e.source_code());
            problems.push(diagnostic_problem(r, source, None, includes));
        }
    }
    problems
}

/// Labels protox gives an earlier, valid definition; the other label is the offending one.
const SECONDARY_LABELS: &[&str] = &["first defined here", "defined here"];

fn diagnostic_problem(
    d: &dyn miette::Diagnostic,
    source: Option<&dyn miette::SourceCode>,
    file: Option<&str>,
    includes: &[PathBuf],
) -> Problem {
    let mut places: Vec<(bool, Location)> = Vec::new();
    if let (Some(source), Some(labels)) = (source, d.labels()) {
        for label in labels {
            let Ok(span) = source.read_span(label.inner(), 0, 0) else {
                continue;
            };
            let name = span.name().or(file).unwrap_or_default().to_owned();
            let text = label.label().unwrap_or_default();
            let primary = label.primary() || !SECONDARY_LABELS.contains(&text);
            let width = std::str::from_utf8(span.data())
                .ok()
                .and_then(|d| d.get(span.column()..))
                .map_or(label.len(), |rest| {
                    rest.lines().next().unwrap_or_default().chars().count()
                })
                .min(label.len().max(1));
            places.push((
                primary,
                Location::new(
                    &name,
                    span.line() + 1,
                    span.column() + 1,
                    width,
                    text,
                    includes,
                ),
            ));
        }
    }
    let message = match (&places.is_empty(), file) {
        (true, Some(file)) => format!("{file}: {d}"),
        _ => d.to_string(),
    };
    let main = places.iter().position(|(primary, _)| *primary).unwrap_or(0);
    let mut problem = Problem::new(message);
    if main < places.len() {
        let (_, at) = places.remove(main);
        problem = problem.at(Some(at));
    }
    for (_, note) in places {
        problem = problem.note(note);
    }
    problem
}

/// A prost-build `ServiceGenerator` emitting rdma-rpc clients and servers; usable on its own
/// with `prost_build::Config::service_generator`. A service that cannot be generated becomes a
/// `compile_error!` in the output (and is listed by [`ServiceGenerator::errors`]).
#[derive(Debug)]
pub struct ServiceGenerator {
    options: EmitOptions,
    errors: Rc<RefCell<Vec<CodegenError>>>,
    #[cfg(feature = "tonic")]
    tonic: Option<crate::tonic::TonicPart>,
}

impl ServiceGenerator {
    /// A generator emitting with `options`.
    pub fn new(options: EmitOptions) -> Self {
        ServiceGenerator {
            options,
            errors: Rc::default(),
            #[cfg(feature = "tonic")]
            tonic: None,
        }
    }

    /// The errors met so far (shared: stays readable after the generator moved into prost's
    /// `Config`).
    pub fn errors(&self) -> Rc<RefCell<Vec<CodegenError>>> {
        Rc::clone(&self.errors)
    }

    fn fail(&mut self, errors: Vec<CodegenError>, buf: &mut String) {
        for e in &errors {
            let msg = format!("rpc-codegen: {e}");
            buf.push_str(&quote!(::core::compile_error!(#msg);).to_string());
            buf.push('\n');
        }
        self.errors.borrow_mut().extend(errors);
    }
}

impl prost_build::ServiceGenerator for ServiceGenerator {
    fn generate(&mut self, service: prost_build::Service, buf: &mut String) {
        let def = match service_def(&service) {
            Ok(def) => def,
            Err(e) => return self.fail(vec![e], buf),
        };
        #[cfg_attr(not(feature = "tonic"), allow(unused_mut))]
        let mut tokens = match generate(&def, &self.options) {
            Ok(tokens) => tokens,
            Err(errors) => return self.fail(errors, buf),
        };
        #[cfg(feature = "tonic")]
        if let Some(tonic) = &mut self.tonic {
            match tonic.generate(service, &def, &self.options) {
                Ok(t) => tokens.extend(t),
                Err(e) => return self.fail(vec![e], buf),
            }
        }
        push_pretty(&def, &tokens, buf, &mut self.errors.borrow_mut());
    }

    fn finalize_package(&mut self, package: &str, buf: &mut String) {
        #[cfg(feature = "tonic")]
        if let Some(tonic) = &mut self.tonic {
            let tokens = tonic.finalize_package(package, &self.options);
            let def = ServiceDef {
                name: String::new(),
                proto_name: String::new(),
                package: package.to_owned(),
                methods: Vec::new(),
                docs: Vec::new(),
            };
            push_pretty(&def, &tokens, buf, &mut self.errors.borrow_mut());
        }
        #[cfg(not(feature = "tonic"))]
        let _ = (package, buf);
    }
}

fn push_pretty(
    def: &ServiceDef,
    tokens: &TokenStream,
    buf: &mut String,
    errors: &mut Vec<CodegenError>,
) {
    match pretty(tokens) {
        Ok(code) => buf.push_str(&code),
        Err(e) => {
            let e = CodegenError {
                service: def.full_name(),
                method: None,
                message: format!("generated code does not parse (a bug in rpc-codegen): {e}"),
            };
            let msg = e.to_string();
            buf.push_str(&quote!(::core::compile_error!(#msg);).to_string());
            errors.push(e);
        }
    }
}

/// A method's `option idempotency_level` as the IR has it (an unknown number, from a newer
/// protobuf, counts as not declared: never retried after it may have run).
fn idempotency(options: &prost_types::MethodOptions) -> Idempotency {
    use prost_types::method_options::IdempotencyLevel;
    match options
        .idempotency_level
        .and_then(|v| IdempotencyLevel::try_from(v).ok())
    {
        Some(IdempotencyLevel::Idempotent) => Idempotency::Idempotent,
        Some(IdempotencyLevel::NoSideEffects) => Idempotency::NoSideEffects,
        Some(IdempotencyLevel::IdempotencyUnknown) | None => Idempotency::Unknown,
    }
}

/// Maps a prost-build service to the IR.
///
/// # Errors
/// When prost's Rust type names do not parse as types.
pub fn service_def(service: &prost_build::Service) -> Result<ServiceDef, CodegenError> {
    let full_name = if service.package.is_empty() {
        service.proto_name.clone()
    } else {
        format!("{}.{}", service.package, service.proto_name)
    };
    let ty = |s: &str, method: usize| -> Result<syn::Type, CodegenError> {
        syn::parse_str(s).map_err(|e| CodegenError {
            service: full_name.clone(),
            method: Some(method),
            message: format!("message type `{s}` is not a Rust type: {e}"),
        })
    };
    let methods = service
        .methods
        .iter()
        .enumerate()
        .map(|(i, m)| {
            Ok(MethodDef {
                name: m.name.clone(),
                proto_name: m.proto_name.clone(),
                input_type: ty(&m.input_type, i)?,
                output_type: ty(&m.output_type, i)?,
                client_streaming: m.client_streaming,
                server_streaming: m.server_streaming,
                docs: doc_lines(&m.comments.leading, &m.comments.trailing),
                deprecated: m.options.deprecated(),
                idempotency: idempotency(&m.options),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ServiceDef {
        name: service.name.clone(),
        proto_name: service.proto_name.clone(),
        package: service.package.clone(),
        methods,
        docs: doc_lines(&service.comments.leading, &service.comments.trailing),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_read_is_reported_for_rerun_if_changed() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
        let (_, read) = load(
            &[root.join("test/everything.proto")],
            std::slice::from_ref(&root),
        )
        .unwrap();
        let names: Vec<String> = read
            .iter()
            .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        // The file and its import from disk; not the built-in well-known types.
        assert_eq!(names, ["test/common.proto", "test/everything.proto"]);
    }
}
