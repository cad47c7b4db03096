//! The one emitter: [`ServiceDef`] to Rust tokens, in tonic's shape.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote};

use crate::ir::{CallKind, CodegenError, Idempotency, MethodDef, ServiceDef};

/// What to emit and where the runtime lives.
#[derive(Clone, Debug)]
pub struct EmitOptions {
    /// Path of the runtime crate in the generated code (default `::rpc_core`). Generated code
    /// names nothing of it but items of `<crate_path>::codegen`, each by its full path.
    pub crate_path: syn::Path,
    /// Emit the `<service>_client` module.
    pub build_client: bool,
    /// Emit the `<service>_server` module.
    pub build_server: bool,
    /// Visibility of the generated modules (default `pub`).
    pub visibility: syn::Visibility,
    /// State what the runtime needs of each message type (`where Type: RpcMessage`) on every
    /// generated function that uses it, spanned at the type: a type that is not a message is
    /// then reported once, at the type (`#[service]` sets this; `.proto` messages always are).
    pub check_messages: bool,
}

impl Default for EmitOptions {
    fn default() -> Self {
        EmitOptions {
            crate_path: syn::parse_quote!(::rpc_core),
            build_client: true,
            build_server: true,
            visibility: syn::parse_quote!(pub),
            check_messages: false,
        }
    }
}

/// Emits the client and server modules of `service` (as `options` asks).
///
/// # Errors
/// Every problem [`ServiceDef::validate`] finds.
pub fn generate(
    service: &ServiceDef,
    options: &EmitOptions,
) -> Result<TokenStream, Vec<CodegenError>> {
    service.validate()?;
    let mut out = TokenStream::new();
    if options.build_client {
        out.extend(client(service, options));
    }
    if options.build_server {
        out.extend(server(service, options));
    }
    Ok(out)
}

/// Formats tokens that form whole items (a file's content) with prettyplease.
///
/// # Errors
/// When the tokens do not parse as a Rust file.
pub fn pretty(tokens: &TokenStream) -> Result<String, syn::Error> {
    let file: syn::File = syn::parse2(tokens.clone())?;
    Ok(prettyplease::unparse(&file))
}

/// `#[doc = ".."]` attributes for doc lines.
pub(crate) fn doc_attrs(lines: &[String]) -> TokenStream {
    quote! { #( #[doc = #lines] )* }
}

fn ident(name: &str) -> Ident {
    // Names were validated: either a plain identifier or `r#keyword`.
    match name.strip_prefix("r#") {
        Some(raw) => Ident::new_raw(raw, Span::call_site()),
        None => Ident::new(name, Span::call_site()),
    }
}

/// The module-level `#![allow]` every generated module opens with.
fn allow() -> TokenStream {
    quote! {
        #![allow(
            unused_variables,
            unused_imports,
            dead_code,
            missing_docs,
            private_interfaces,
            private_bounds,
            non_camel_case_types,
            non_snake_case,
            clippy::all
        )]
    }
}

/// Re-bases a type written as seen from the parent module for use inside a generated module
/// one level down: relative paths get one more `super::`; absolute paths (`::x`, `crate::x`),
/// primitives and `()` stay as they are.
pub fn rebase(ty: &syn::Type) -> syn::Type {
    let mut ty = ty.clone();
    rebase_in_place(&mut ty);
    ty
}

fn rebase_in_place(ty: &mut syn::Type) {
    match ty {
        syn::Type::Path(p) if p.qself.is_none() => {
            for seg in p.path.segments.iter_mut() {
                if let syn::PathArguments::AngleBracketed(args) = &mut seg.arguments {
                    for arg in args.args.iter_mut() {
                        if let syn::GenericArgument::Type(t) = arg {
                            rebase_in_place(t);
                        }
                    }
                }
            }
            if p.path.leading_colon.is_some() {
                return;
            }
            let first = p
                .path
                .segments
                .first()
                .map(|s| s.ident.to_string())
                .unwrap_or_default();
            match first.as_str() {
                "crate" => {}
                "self" => {
                    if let Some(seg) = p.path.segments.first_mut() {
                        seg.ident = Ident::new("super", seg.ident.span());
                    }
                }
                _ if p.path.segments.len() == 1 && is_primitive(&first) => {}
                _ => {
                    // Spanned like the type, so that errors about it point at the user's type.
                    let span = p
                        .path
                        .segments
                        .first()
                        .map_or(Span::call_site(), |s| s.ident.span());
                    let sup = syn::PathSegment::from(Ident::new("super", span));
                    p.path.segments.insert(0, sup);
                }
            }
        }
        syn::Type::Paren(p) => rebase_in_place(&mut p.elem),
        syn::Type::Group(g) => rebase_in_place(&mut g.elem),
        syn::Type::Reference(r) => rebase_in_place(&mut r.elem),
        syn::Type::Slice(s) => rebase_in_place(&mut s.elem),
        syn::Type::Array(a) => rebase_in_place(&mut a.elem),
        syn::Type::Tuple(t) => t.elems.iter_mut().for_each(rebase_in_place),
        _ => {}
    }
}

/// Whether `name` is a primitive type (a type prost may give a message: the wrappers' `i64`..).
pub(crate) fn is_primitive(name: &str) -> bool {
    matches!(
        name,
        "bool"
            | "char"
            | "str"
            | "i8"
            | "i16"
            | "i32"
            | "i64"
            | "i128"
            | "isize"
            | "u8"
            | "u16"
            | "u32"
            | "u64"
            | "u128"
            | "usize"
            | "f32"
            | "f64"
    )
}

/// `<crate_path>::codegen`: every runtime item generated code names is spelt out from there,
/// so that no name of the user's (a message, service or method called `Status`, `Channel`..)
/// meets one of ours.
fn runtime(options: &EmitOptions) -> TokenStream {
    let krate = &options.crate_path;
    quote!(#krate::codegen)
}

/// One client type over a channel: the struct, its `methods`, `new`, `From<Channel>`,
/// `AsRef<Channel>` and, for the blocking and pipeline clients, `From<#client>`.
fn client_struct(
    ty: &Ident,
    docs: TokenStream,
    methods: TokenStream,
    rt: &TokenStream,
    what: &str,
    from_client: Option<&Ident>,
) -> TokenStream {
    let new_doc = format!(" {what} over `inner` (channels are cheap to clone and share).");
    let from_client = from_client.map(|client| {
        quote! {
            impl ::core::convert::From<#client> for #ty {
                fn from(client: #client) -> Self {
                    Self { inner: client.inner }
                }
            }
        }
    });
    quote! {
        #docs
        #[derive(::core::fmt::Debug, ::core::clone::Clone)]
        pub struct #ty {
            inner: #rt::Channel,
        }

        impl #ty {
            #[doc = #new_doc]
            pub fn new(inner: #rt::Channel) -> Self {
                Self { inner }
            }

            /// A client whose calls pass `f` before they are sent (tonic's
            /// `with_interceptor`): see `Channel::with_interceptor`.
            pub fn with_interceptor<F: #rt::Interceptor>(inner: #rt::Channel, f: F) -> Self {
                Self { inner: inner.with_interceptor(f) }
            }

            #methods
        }

        impl ::core::convert::From<#rt::Channel> for #ty {
            fn from(inner: #rt::Channel) -> Self {
                Self { inner }
            }
        }

        impl ::core::convert::AsRef<#rt::Channel> for #ty {
            fn as_ref(&self) -> &#rt::Channel {
                &self.inner
            }
        }

        #from_client
    }
}

fn client(service: &ServiceDef, options: &EmitOptions) -> TokenStream {
    let rt = runtime(options);
    let vis = &options.visibility;
    let module = ident(&service.client_mod());
    let client = ident(&service.client_type());
    let blocking = ident(&service.blocking_client_type());
    let pipeline = ident(&service.pipeline_client_type());
    let full_name = service.full_name();
    let service_docs = doc_attrs(&service.docs);
    let allow = allow();
    let connect_doc = format!(
        " Connects to the server at `addr` (`host:port`) and returns a client of `{full_name}`."
    );
    let methods = service
        .methods
        .iter()
        .map(|m| client_method(service, m, &rt, options));
    let unary: Vec<&MethodDef> = service
        .methods
        .iter()
        .filter(|m| m.kind() == CallKind::Unary)
        .collect();
    let blocking_methods = unary
        .iter()
        .map(|m| variant_method(service, m, &rt, options, true));
    let pipeline_methods = unary
        .iter()
        .map(|m| variant_method(service, m, &rt, options, false));
    let blocking_doc = format!(
        " Blocking calls of `{full_name}` for the lowest latency: the calling thread polls the \
         completion queue itself. The unary methods of [`{client}`], under the same names; \
         build it with `From` from a [`{client}`] or a channel."
    );
    let pipeline_doc = format!(
        " Pipelines of `{full_name}`: one method per unary method of [`{client}`], under the \
         same name, opening a pipeline of that method (many calls in flight from one thread \
         without async tasks: submit with a tag, collect responses with `poll`/`wait`). Build \
         it with `From` from a [`{client}`] or a channel."
    );
    let async_methods = quote! {
        #[doc = #connect_doc]
        ///
        /// # Errors
        /// When the address does not resolve, the connection fails or the handshake is
        /// refused.
        ///
        /// # Cancel safety
        /// Dropping the future abandons the attempt and frees what it set up.
        pub async fn connect(
            addr: impl ::core::convert::AsRef<str>,
        ) -> ::core::result::Result<Self, #rt::TransportError> {
            let inner = #rt::Channel::connect(addr).await?;
            ::core::result::Result::Ok(Self { inner })
        }

        #(#methods)*
    };
    let async_client = client_struct(&client, service_docs, async_methods, &rt, "A client", None);
    let blocking_client = client_struct(
        &blocking,
        quote!(#[doc = #blocking_doc]),
        quote!(#(#blocking_methods)*),
        &rt,
        "A blocking client",
        Some(&client),
    );
    let pipeline_client = client_struct(
        &pipeline,
        quote!(#[doc = #pipeline_doc]),
        quote!(#(#pipeline_methods)*),
        &rt,
        "A pipeline client",
        Some(&client),
    );

    quote! {
        /// Generated client implementations.
        #vis mod #module {
            #allow

            #async_client
            #blocking_client
            #pipeline_client
        }
    }
}

fn method_desc(service: &ServiceDef, m: &MethodDef, rt: &TokenStream) -> TokenStream {
    let path = service.method_path(m);
    let kind = format_ident!("{}", m.kind().variant());
    match m.idempotency {
        Idempotency::Unknown => quote! { #rt::MethodDesc::new(#path, #rt::CallKind::#kind) },
        level => {
            let level = format_ident!("{}", level.variant());
            quote! {
                #rt::MethodDesc::new(#path, #rt::CallKind::#kind)
                    .with_idempotency(#rt::Idempotency::#level)
            }
        }
    }
}

/// The method's docs, or one line naming its path when it has none.
fn method_docs(service: &ServiceDef, m: &MethodDef, verb: &str) -> TokenStream {
    if m.docs.is_empty() {
        doc_attrs(&[format!(" {verb} `{}`.", service.method_path(m))])
    } else {
        doc_attrs(&m.docs)
    }
}

/// `where Input: RpcMessage, Output: RpcMessage` when `options.check_messages` (see
/// [`message_bound`]).
fn message_bounds(types: &[&syn::Type], rt: &TokenStream, options: &EmitOptions) -> TokenStream {
    if !options.check_messages {
        return TokenStream::new();
    }
    let preds = types.iter().map(|ty| message_bound(ty, rt));
    quote! { where #(#preds),* }
}

/// The predicate `ty: <runtime>::RpcMessage`, every token spanned at `ty`, so that a type that
/// is not a message is reported at the type (and the identical reports of every function
/// stating it merge into one).
pub fn message_bound(ty: &syn::Type, runtime: &TokenStream) -> TokenStream {
    let span = syn::spanned::Spanned::span(ty);
    let bound = respan(quote!(: #runtime::RpcMessage), span);
    let ty = respan(quote!(#ty), span);
    quote!(#ty #bound)
}

/// `tokens` with every span set to `span`.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut t| {
            if let proc_macro2::TokenTree::Group(g) = &t {
                let mut group = proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                group.set_span(span);
                t = proc_macro2::TokenTree::Group(group);
            } else {
                t.set_span(span);
            }
            t
        })
        .collect()
}

fn deprecated(m: &MethodDef) -> TokenStream {
    if m.deprecated {
        quote! { #[deprecated] }
    } else {
        TokenStream::new()
    }
}

fn errors_doc() -> TokenStream {
    quote! {
        ///
        /// # Errors
        /// The call's status: the handler's error, or the runtime's when the call could not be
        /// completed.
    }
}

fn client_method(
    service: &ServiceDef,
    m: &MethodDef,
    rt: &TokenStream,
    options: &EmitOptions,
) -> TokenStream {
    let name = ident(&m.name);
    let docs = method_docs(service, m, "Calls");
    let input = rebase(&m.input_type);
    let output = rebase(&m.output_type);
    let bounds = message_bounds(&[&input, &output], rt, options);
    let desc = method_desc(service, m, rt);
    let deprecated = deprecated(m);
    let errors_doc = errors_doc();
    let cancel_doc = quote! {
        ///
        /// # Cancel safety
        /// Dropping the future cancels the call: the server is told, and buffers return to
        /// their pools only after the NIC is done with them.
    };
    let (request, into, response, run) = match m.kind() {
        CallKind::Unary => (
            quote!(impl #rt::IntoRequest<#input>),
            quote!(<_ as #rt::IntoRequest<#input>>::into_request),
            quote!(#rt::Response<#output>),
            quote!(unary),
        ),
        CallKind::ServerStreaming => (
            quote!(impl #rt::IntoRequest<#input>),
            quote!(<_ as #rt::IntoRequest<#input>>::into_request),
            quote!(#rt::Response<#rt::Streaming<#output>>),
            quote!(server_streaming),
        ),
        CallKind::ClientStreaming => (
            quote!(impl #rt::IntoStreamingRequest<Message = #input>),
            quote!(#rt::IntoStreamingRequest::into_streaming_request),
            quote!(#rt::Response<#output>),
            quote!(client_streaming),
        ),
        CallKind::Streaming => (
            quote!(impl #rt::IntoStreamingRequest<Message = #input>),
            quote!(#rt::IntoStreamingRequest::into_streaming_request),
            quote!(#rt::Response<#rt::Streaming<#output>>),
            quote!(streaming),
        ),
    };
    quote! {
        #docs
        #errors_doc
        #cancel_doc
        #deprecated
        pub async fn #name(
            &self,
            request: #request,
        ) -> ::core::result::Result<#response, #rt::Status>
        #bounds
        {
            const METHOD: #rt::MethodDesc = #desc;
            self.inner.#run(&METHOD, #into(request)).await
        }
    }
}

/// A unary method's entry point on the blocking client (`blocking`) or the pipeline client.
fn variant_method(
    service: &ServiceDef,
    m: &MethodDef,
    rt: &TokenStream,
    options: &EmitOptions,
    blocking: bool,
) -> TokenStream {
    let name = ident(&m.name);
    let input = rebase(&m.input_type);
    let output = rebase(&m.output_type);
    let bounds = message_bounds(&[&input, &output], rt, options);
    let desc = method_desc(service, m, rt);
    let deprecated = deprecated(m);
    let target = format!("{}::{}", service.client_type(), m.plain_name());
    let (doc, errors_doc, params, returns, call) = if blocking {
        (
            format!(
                " Blocking variant of [`{target}`]: the calling thread polls the completion queue itself."
            ),
            errors_doc(),
            quote!(request: impl #rt::IntoRequest<#input>),
            quote!(#rt::Response<#output>),
            quote!(unary_blocking(&METHOD, <_ as #rt::IntoRequest<#input>>::into_request(request))),
        )
    } else {
        (
            format!(
                " A pipeline of [`{target}`]: many calls in flight from one thread without async \
                 tasks (see `Channel::pipeline`)."
            ),
            quote! {
                ///
                /// # Errors
                /// `UNAVAILABLE` when there is no connection and reconnecting fails.
            },
            TokenStream::new(),
            quote!(#rt::Pipeline<#input, #output>),
            quote!(pipeline(&METHOD)),
        )
    };
    quote! {
        #[doc = #doc]
        #errors_doc
        #deprecated
        pub fn #name(
            &self,
            #params
        ) -> ::core::result::Result<#returns, #rt::Status>
        #bounds
        {
            const METHOD: #rt::MethodDesc = #desc;
            self.inner.#call
        }
    }
}

fn server(service: &ServiceDef, options: &EmitOptions) -> TokenStream {
    let rt = runtime(options);
    let vis = &options.visibility;
    let module = ident(&service.server_mod());
    let trait_name = ident(&service.name);
    let server = ident(&service.server_type());
    let t = ident(service.type_param());
    let full_name = service.full_name();
    let service_docs = doc_attrs(&service.docs);
    let allow = allow();

    let consts = service.methods.iter().map(|m| {
        let c = ident(&m.const_name());
        let desc = method_desc(service, m, &rt);
        let doc = format!(" `{}`.", service.method_path(m));
        quote! {
            #[doc = #doc]
            pub const #c: #rt::MethodDesc = #desc;
        }
    });
    let const_names = service.methods.iter().map(|m| ident(&m.const_name()));
    let methods_doc =
        format!(" Every method of `{full_name}`, in declaration order (also `Service::methods`).");
    let trait_items = service
        .methods
        .iter()
        .map(|m| trait_item(&trait_name, m, method_docs(service, m, "Handles"), &rt));
    let all_types: Vec<syn::Type> = service
        .methods
        .iter()
        .flat_map(|m| [rebase(&m.input_type), rebase(&m.output_type)])
        .collect();
    let service_bounds = message_bounds(&all_types.iter().collect::<Vec<_>>(), &rt, options);
    let arms = service
        .methods
        .iter()
        .map(|m| dispatch_arm(&trait_name, &t, m));
    let server_doc = format!(
        " Serves a [`{trait_name}`] implementation as `{full_name}`: hand it to the server \
         builder's `add_service`."
    );

    quote! {
        /// Generated server implementations.
        #vis mod #module {
            #allow

            #(#consts)*

            #service_docs
            pub trait #trait_name: ::core::marker::Send + ::core::marker::Sync + 'static {
                #(#trait_items)*
            }

            #[doc = #server_doc]
            pub struct #server<#t> {
                inner: #rt::Arc<#t>,
            }

            impl<#t> #server<#t> {
                #[doc = #methods_doc]
                pub const METHODS: &'static [#rt::MethodDesc] = &[#(#const_names),*];
            }

            impl<#t: #trait_name> #server<#t> {
                /// Serves `inner`.
                pub fn new(inner: #t) -> Self {
                    Self::from_arc(#rt::Arc::new(inner))
                }

                /// Serves a shared `inner`.
                pub fn from_arc(inner: #rt::Arc<#t>) -> Self {
                    Self { inner }
                }

                /// Serves `inner` with `f` run on every call's request metadata before its
                /// handler (tonic's `with_interceptor`); a status from `f` ends the call.
                pub fn with_interceptor<F: #rt::Interceptor>(
                    inner: #t,
                    f: F,
                ) -> #rt::InterceptedService<Self, F> {
                    #rt::InterceptedService::new(Self::new(inner), f)
                }
            }

            impl<#t> ::core::clone::Clone for #server<#t> {
                fn clone(&self) -> Self {
                    Self { inner: ::core::clone::Clone::clone(&self.inner) }
                }
            }

            impl<#t> ::core::fmt::Debug for #server<#t> {
                fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                    f.debug_struct(::core::stringify!(#server)).finish_non_exhaustive()
                }
            }

            impl<#t: #trait_name> #rt::Service for #server<#t> #service_bounds {
                fn name(&self) -> &'static str {
                    #full_name
                }

                fn methods(&self) -> &'static [#rt::MethodDesc] {
                    Self::METHODS
                }

                fn call(&self, method: u32, call: #rt::IncomingCall<'_>) -> #rt::Dispatched {
                    match method {
                        #(#arms)*
                        _ => call.unimplemented(),
                    }
                }
            }
        }
    }
}

fn trait_item(
    trait_name: &Ident,
    m: &MethodDef,
    docs: TokenStream,
    rt: &TokenStream,
) -> TokenStream {
    let name = ident(&m.name);
    let input = rebase(&m.input_type);
    let output = rebase(&m.output_type);
    let request = if m.client_streaming {
        quote! { #rt::Request<#rt::Streaming<#input>> }
    } else {
        quote! { #rt::Request<#input> }
    };
    if m.server_streaming {
        let stream = ident(&m.stream_type());
        let stream_doc = format!(
            " The stream of responses of [`{trait_name}::{}`].",
            m.plain_name()
        );
        quote! {
            #[doc = #stream_doc]
            type #stream: #rt::Stream<Item = ::core::result::Result<#output, #rt::Status>>
                + ::core::marker::Send
                + 'static;

            #docs
            fn #name(
                &self,
                request: #request,
            ) -> impl #rt::Future<
                Output = ::core::result::Result<#rt::Response<Self::#stream>, #rt::Status>,
            > + ::core::marker::Send;
        }
    } else {
        quote! {
            #docs
            fn #name(
                &self,
                request: #request,
            ) -> impl #rt::Future<Output = ::core::result::Result<#rt::Response<#output>, #rt::Status>>
                   + ::core::marker::Send;
        }
    }
}

fn dispatch_arm(trait_name: &Ident, t: &Ident, m: &MethodDef) -> TokenStream {
    let name = ident(&m.name);
    let c = ident(&m.const_name());
    let run = match m.kind() {
        CallKind::Unary => quote!(unary),
        CallKind::ServerStreaming => quote!(server_streaming),
        CallKind::ClientStreaming => quote!(client_streaming),
        CallKind::Streaming => quote!(streaming),
    };
    quote! {
        id if id == #c.id => {
            let inner = ::core::clone::Clone::clone(&self.inner);
            call.#run(move |request| async move {
                <#t as #trait_name>::#name(&inner, request).await
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(s: &str) -> String {
        let t: syn::Type = syn::parse_str(s).unwrap();
        let r = rebase(&t);
        quote!(#r).to_string().replace(' ', "")
    }

    #[test]
    fn rebase_adds_one_super_to_relative_paths_only() {
        assert_eq!(ty("HelloRequest"), "super::HelloRequest");
        assert_eq!(ty("super::common::Empty"), "super::super::common::Empty");
        assert_eq!(ty("self::X"), "super::X");
        assert_eq!(ty("::prost_types::Timestamp"), "::prost_types::Timestamp");
        assert_eq!(ty("crate::msgs::X"), "crate::msgs::X");
        assert_eq!(ty("()"), "()");
        assert_eq!(ty("bool"), "bool");
        assert_eq!(ty("a::Wrap<B>"), "super::a::Wrap<super::B>");
    }
}
