//! `emit_tonic`: tonic's gRPC client and server for the same services, generated in the same
//! prost pass by tonic-prost-build's service generator, plus an adapter serving one
//! implementation of our server trait over tonic.
//!
//! Per service `Greeter` this adds a module `greeter_tonic` holding tonic's own
//! `greeter_client` and `greeter_server` modules and `GreeterTonicAdapter<T>`, which implements
//! tonic's `Greeter` trait for any `T` implementing ours by converting requests (metadata and
//! `grpc-timeout`), responses (metadata) and statuses (code, message, metadata) both ways.
//! Once per package a hidden module `__rpc_tonic` holds the conversions.
//!
//! Limits: client-streaming and bidirectional methods answer `UNIMPLEMENTED` through the
//! adapter, because `rpc_core::codegen::Streaming` cannot yet be built from tonic's stream (the
//! contract lacks a constructor); implement tonic's trait directly for those. Metadata entries
//! whose keys or values one side cannot represent are dropped. tonic's own code does not compile
//! for a service named like an item it names without a path (`Arc`, `Box`, `Option`,
//! `Default`, `Context`, `Poll`, `Body`, `BoxFuture`, `StdError`): its trait of that name shadows
//! the item in its module. Generate those services without `emit_tonic`.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote};

use crate::emit::{EmitOptions, is_primitive, rebase};
use crate::ir::{CallKind, CodegenError, ServiceDef};

/// Name of the per-package module with the conversions.
const COMPAT: &str = "__rpc_tonic";

/// The tonic half of the combined generator.
pub(crate) struct TonicPart {
    inner: Box<dyn prost_build::ServiceGenerator>,
    build_server: bool,
}

impl std::fmt::Debug for TonicPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TonicPart")
            .field("build_server", &self.build_server)
            .finish_non_exhaustive()
    }
}

impl TonicPart {
    pub(crate) fn new(build_client: bool, build_server: bool) -> Self {
        // tonic's modules go one level deeper (inside `<service>_tonic`), so its message paths
        // start at `super::super`.
        let inner = tonic_prost_build::configure()
            .build_client(build_client)
            .build_server(build_server)
            .proto_path("super::super")
            .service_generator();
        TonicPart {
            inner,
            build_server,
        }
    }

    /// tonic's code for `service` and our adapter, wrapped in `<service>_tonic`.
    pub(crate) fn generate(
        &mut self,
        service: prost_build::Service,
        def: &ServiceDef,
        options: &EmitOptions,
    ) -> Result<TokenStream, CodegenError> {
        let mut code = String::new();
        self.inner.generate(absolute_primitives(service), &mut code);
        let tonic: TokenStream = code.parse().map_err(|e| CodegenError {
            service: def.full_name(),
            method: None,
            message: format!("tonic's generated code does not tokenize: {e}"),
        })?;
        let adapter = if self.build_server && options.build_server {
            adapter(def)
        } else {
            TokenStream::new()
        };
        let module = ident(&def.tonic_mod());
        let vis = &options.visibility;
        let doc = format!(
            " gRPC (tonic) client and server for `{}`, and an adapter serving an rdma-rpc \
             implementation over gRPC.",
            def.full_name()
        );
        Ok(quote! {
            #[doc = #doc]
            #vis mod #module {
                #![allow(unused_variables, unused_imports, dead_code, missing_docs, non_camel_case_types, non_snake_case, clippy::all)]
                #![allow(rustdoc::bare_urls, rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
                #tonic
                #adapter
            }
        })
    }

    /// The conversions, once per package.
    pub(crate) fn finalize_package(&mut self, package: &str, options: &EmitOptions) -> TokenStream {
        let mut buf = String::new();
        self.inner.finalize_package(package, &mut buf);
        let extra: TokenStream = buf.parse().unwrap_or_default();
        if !(self.build_server && options.build_server) {
            return extra;
        }
        let compat = compat(&options.crate_path);
        quote! { #extra #compat }
    }
}

/// `service` with primitive message types (prost's types for the wrappers: `Int64Value` is
/// `i64`, `BoolValue` `bool`..) spelt `::core::primitive::i64`: tonic-prost-build puts its
/// message path (`super::super`) before any type not starting with `::` or `crate::` (unless
/// built `with_extended_rust_types`, which its service generator alone cannot be), and
/// `super::super::i64` does not exist.
fn absolute_primitives(mut service: prost_build::Service) -> prost_build::Service {
    for m in &mut service.methods {
        for ty in [&mut m.input_type, &mut m.output_type] {
            if is_primitive(ty) {
                *ty = format!("::core::primitive::{ty}");
            }
        }
    }
    service
}

fn ident(name: &str) -> Ident {
    match name.strip_prefix("r#") {
        Some(raw) => Ident::new_raw(raw, Span::call_site()),
        None => Ident::new(name, Span::call_site()),
    }
}

fn adapter(def: &ServiceDef) -> TokenStream {
    let compat = ident(COMPAT);
    let our_mod = ident(&def.server_mod());
    let trait_name = ident(&def.name);
    let adapter = format_ident!("{}TonicAdapter", def.name);
    let doc = format!(
        " Serves an rdma-rpc [`{0}`](super::{1}::{0}) implementation over gRPC: \
         `tonic::transport::Server::builder().add_service({2}::new(service).into_service())`.",
        def.name,
        def.server_mod(),
        adapter
    );
    let methods = def.methods.iter().map(|m| {
        let name = ident(&m.name);
        let input = rebase(&m.input_type);
        let output = rebase(&m.output_type);
        let path = def.method_path(m);
        let ours = quote! { <T as super::#our_mod::#trait_name>::#name };
        match m.kind() {
            CallKind::Unary => quote! {
                async fn #name(
                    &self,
                    request: ::tonic::Request<#input>,
                ) -> ::core::result::Result<::tonic::Response<#output>, ::tonic::Status> {
                    let request = super::#compat::request_from_tonic(request);
                    super::#compat::response_to_tonic(#ours(&self.inner, request).await)
                }
            },
            CallKind::ServerStreaming => {
                let tonic_stream = format_ident!("{}Stream", m.proto_name);
                let our_stream = ident(&m.stream_type());
                quote! {
                    type #tonic_stream = super::#compat::StatusStream<
                        <T as super::#our_mod::#trait_name>::#our_stream,
                    >;

                    async fn #name(
                        &self,
                        request: ::tonic::Request<#input>,
                    ) -> ::core::result::Result<::tonic::Response<Self::#tonic_stream>, ::tonic::Status> {
                        let request = super::#compat::request_from_tonic(request);
                        super::#compat::stream_response_to_tonic(#ours(&self.inner, request).await)
                    }
                }
            }
            CallKind::ClientStreaming => quote! {
                async fn #name(
                    &self,
                    request: ::tonic::Request<::tonic::Streaming<#input>>,
                ) -> ::core::result::Result<::tonic::Response<#output>, ::tonic::Status> {
                    ::core::result::Result::Err(super::#compat::streaming_requests_unsupported(#path))
                }
            },
            CallKind::Streaming => {
                let tonic_stream = format_ident!("{}Stream", m.proto_name);
                let our_stream = ident(&m.stream_type());
                quote! {
                    type #tonic_stream = super::#compat::StatusStream<
                        <T as super::#our_mod::#trait_name>::#our_stream,
                    >;

                    async fn #name(
                        &self,
                        request: ::tonic::Request<::tonic::Streaming<#input>>,
                    ) -> ::core::result::Result<::tonic::Response<Self::#tonic_stream>, ::tonic::Status> {
                        ::core::result::Result::Err(super::#compat::streaming_requests_unsupported(#path))
                    }
                }
            }
        }
    });
    let tonic_server = format_ident!("{}Server", def.name);

    quote! {
        #[doc = #doc]
        pub struct #adapter<T> {
            inner: ::std::sync::Arc<T>,
        }

        impl<T: super::#our_mod::#trait_name> #adapter<T> {
            /// Adapts `inner`.
            pub fn new(inner: T) -> Self {
                Self::from_arc(::std::sync::Arc::new(inner))
            }

            /// Adapts a shared `inner` (the same one may be served by rdma-rpc too).
            pub fn from_arc(inner: ::std::sync::Arc<T>) -> Self {
                Self { inner }
            }

            /// tonic's service for this adapter, to add to a `tonic::transport::Server`.
            pub fn into_service(self) -> #our_mod::#tonic_server<Self> {
                #our_mod::#tonic_server::new(self)
            }
        }

        impl<T> ::core::clone::Clone for #adapter<T> {
            fn clone(&self) -> Self {
                Self { inner: ::std::sync::Arc::clone(&self.inner) }
            }
        }

        impl<T> ::core::fmt::Debug for #adapter<T> {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.debug_struct(::core::stringify!(#adapter)).finish_non_exhaustive()
            }
        }

        #[::tonic::codegen::async_trait]
        impl<T: super::#our_mod::#trait_name> #our_mod::#trait_name for #adapter<T> {
            #(#methods)*
        }
    }
}

/// The conversions between tonic's and rdma-rpc's request, response, status and metadata.
fn compat(krate: &syn::Path) -> TokenStream {
    let module = ident(COMPAT);
    quote! {
        /// Conversions between tonic's and rdma-rpc's requests, responses, statuses and
        /// metadata, used by the generated tonic adapters.
        #[doc(hidden)]
        pub mod #module {
            #![allow(dead_code, missing_docs, clippy::all)]
            use #krate::codegen::*;

            /// Headers of the gRPC protocol itself, not carried over as metadata.
            fn is_protocol_header(key: &str) -> bool {
                key.starts_with("grpc-") || key == "te" || key == "content-type" || key == "user-agent"
            }

            /// tonic's request to ours: message, metadata (entries our metadata cannot hold are
            /// dropped) and the `grpc-timeout` as the timeout.
            pub fn request_from_tonic<M>(request: ::tonic::Request<M>) -> Request<M> {
                let (metadata, _extensions, message) = request.into_parts();
                let timeout = metadata
                    .get("grpc-timeout")
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_grpc_timeout);
                let mut ours = Metadata::new();
                for entry in metadata.iter() {
                    match entry {
                        ::tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                            if !is_protocol_header(k.as_str()) {
                                let _ = ours.insert(k.as_str(), v.as_bytes());
                            }
                        }
                        ::tonic::metadata::KeyAndValueRef::Binary(k, v) => {
                            if let ::core::result::Result::Ok(bytes) = v.to_bytes() {
                                let _ = ours.insert(k.as_str(), bytes.as_ref());
                            }
                        }
                    }
                }
                Request::from_parts(ours, message, timeout)
            }

            /// gRPC's timeout header: up to 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
            fn parse_grpc_timeout(value: &str) -> ::core::option::Option<::core::time::Duration> {
                let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
                if digits.is_empty() || digits.len() > 8 {
                    return ::core::option::Option::None;
                }
                let n: u64 = digits.parse().ok()?;
                ::core::option::Option::Some(match unit {
                    "H" => ::core::time::Duration::from_secs(n * 3600),
                    "M" => ::core::time::Duration::from_secs(n * 60),
                    "S" => ::core::time::Duration::from_secs(n),
                    "m" => ::core::time::Duration::from_millis(n),
                    "u" => ::core::time::Duration::from_micros(n),
                    "n" => ::core::time::Duration::from_nanos(n),
                    _ => return ::core::option::Option::None,
                })
            }

            /// Our metadata into tonic's (`-bin` keys as binary entries).
            fn metadata_to_tonic(from: &Metadata, to: &mut ::tonic::metadata::MetadataMap) {
                for (k, v) in from.iter() {
                    if k.ends_with("-bin") {
                        if let ::core::result::Result::Ok(key) =
                            ::tonic::metadata::BinaryMetadataKey::from_bytes(k.as_bytes())
                        {
                            to.insert_bin(key, ::tonic::metadata::BinaryMetadataValue::from_bytes(v));
                        }
                    } else if let (::core::result::Result::Ok(key), ::core::result::Result::Ok(value)) = (
                        ::tonic::metadata::AsciiMetadataKey::from_bytes(k.as_bytes()),
                        ::tonic::metadata::AsciiMetadataValue::try_from(v),
                    ) {
                        to.insert(key, value);
                    }
                }
            }

            /// Our status to tonic's: same code, message and metadata.
            pub fn status_to_tonic(status: Status) -> ::tonic::Status {
                let mut metadata = ::tonic::metadata::MetadataMap::new();
                metadata_to_tonic(status.metadata(), &mut metadata);
                ::tonic::Status::with_metadata(
                    ::tonic::Code::from(status.code() as i32),
                    status.message(),
                    metadata,
                )
            }

            /// Our unary outcome to tonic's.
            pub fn response_to_tonic<M>(
                response: ::core::result::Result<Response<M>, Status>,
            ) -> ::core::result::Result<::tonic::Response<M>, ::tonic::Status> {
                let (metadata, message) = response.map_err(status_to_tonic)?.into_parts();
                let mut out = ::tonic::Response::new(message);
                metadata_to_tonic(&metadata, out.metadata_mut());
                ::core::result::Result::Ok(out)
            }

            /// Our streaming outcome to tonic's.
            pub fn stream_response_to_tonic<S>(
                response: ::core::result::Result<Response<S>, Status>,
            ) -> ::core::result::Result<::tonic::Response<StatusStream<S>>, ::tonic::Status> {
                let (metadata, stream) = response.map_err(status_to_tonic)?.into_parts();
                let mut out = ::tonic::Response::new(StatusStream {
                    inner: ::std::boxed::Box::pin(stream),
                });
                metadata_to_tonic(&metadata, out.metadata_mut());
                ::core::result::Result::Ok(out)
            }

            /// The answer of adapted client-streaming and bidirectional methods.
            pub fn streaming_requests_unsupported(path: &str) -> ::tonic::Status {
                ::tonic::Status::unimplemented(::std::format!(
                    "{path}: the rdma-rpc tonic adapter cannot serve streaming requests yet \
                     (rpc_core::Streaming cannot be built from tonic's stream); implement \
                     tonic's trait for this service directly"
                ))
            }

            /// Our response stream as tonic's: statuses converted.
            pub struct StatusStream<S> {
                inner: ::core::pin::Pin<::std::boxed::Box<S>>,
            }

            impl<S> ::core::fmt::Debug for StatusStream<S> {
                fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                    f.write_str("StatusStream")
                }
            }

            impl<S, M> Stream for StatusStream<S>
            where
                S: Stream<Item = ::core::result::Result<M, Status>>,
            {
                type Item = ::core::result::Result<M, ::tonic::Status>;

                fn poll_next(
                    self: ::core::pin::Pin<&mut Self>,
                    cx: &mut ::core::task::Context<'_>,
                ) -> ::core::task::Poll<::core::option::Option<Self::Item>> {
                    self.get_mut()
                        .inner
                        .as_mut()
                        .poll_next(cx)
                        .map(|item| item.map(|r| r.map_err(status_to_tonic)))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method(input: &str, output: &str) -> prost_build::Method {
        prost_build::Method {
            name: "m".into(),
            proto_name: "M".into(),
            comments: prost_build::Comments::default(),
            input_type: input.into(),
            output_type: output.into(),
            input_proto_type: String::new(),
            output_proto_type: String::new(),
            options: prost_types::MethodOptions::default(),
            client_streaming: false,
            server_streaming: false,
        }
    }

    #[test]
    fn primitive_message_types_reach_tonic_as_absolute_paths() {
        let service = prost_build::Service {
            name: "S".into(),
            proto_name: "S".into(),
            package: "p".into(),
            comments: prost_build::Comments::default(),
            methods: vec![
                method("i64", "bool"),
                method("()", "::prost::alloc::string::String"),
                method("super::common::Point", "f32"),
            ],
            options: prost_types::ServiceOptions::default(),
        };
        let types: Vec<(String, String)> = absolute_primitives(service)
            .methods
            .into_iter()
            .map(|m| (m.input_type, m.output_type))
            .collect();
        let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            types,
            [
                pair("::core::primitive::i64", "::core::primitive::bool"),
                pair("()", "::prost::alloc::string::String"),
                pair("super::common::Point", "::core::primitive::f32"),
            ]
        );
    }
}
