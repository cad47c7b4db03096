//! Parse the trait -> check it (errors accumulated with spans) -> IR -> the shared emitter, plus
//! the rewritten trait and the bridge to the generated server trait.

use heck::ToUpperCamelCase;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{
    FnArg, GenericArgument, Ident, ItemTrait, PathArguments, ReturnType, TraitItem, TraitItemFn,
    TraitItemType, Type, TypeParamBound,
};

use rpc_codegen::{EmitOptions, Idempotency, MethodDef, ServiceDef};

/// `#[service(..)]` arguments.
struct Args {
    package: String,
    crate_path: syn::Path,
}

/// Collects errors; `into_result` combines them into one `syn::Error`.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    fn at(&mut self, span: Span, msg: impl std::fmt::Display) {
        self.push(syn::Error::new(span, msg));
    }

    fn into_result(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// One checked method: where it came from and what it maps to.
struct Method {
    ident: Ident,
    /// The request type as written (the message, or `Streaming<Message>`'s inner message).
    input: Type,
    /// The response message type.
    output: Type,
    client_streaming: bool,
    /// For server streaming: the user's associated stream type.
    stream: Option<Ident>,
    docs: Vec<String>,
    deprecated: bool,
    idempotency: Idempotency,
}

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    match try_expand(attr, item.clone()) {
        Ok(tokens) => tokens,
        Err(e) => {
            // Keep the trait so that its uses do not add errors of their own (without our
            // `#[rpc(..)]` attributes, which rustc does not know).
            let errors = e.to_compile_error();
            match syn::parse2::<ItemTrait>(item.clone()) {
                Ok(mut t) => {
                    for it in &mut t.items {
                        if let TraitItem::Fn(f) = it {
                            f.attrs.retain(|a| !a.path().is_ident("rpc"));
                        }
                    }
                    quote! { #t #errors }
                }
                Err(_) => quote! { #item #errors },
            }
        }
    }
}

fn try_expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    let args = match parse_args(attr) {
        Ok(args) => args,
        Err(e) => {
            errors.push(e);
            Args {
                package: String::new(),
                crate_path: syn::parse_quote!(::rpc_core),
            }
        }
    };
    let item: ItemTrait = syn::parse2(item)
        .map_err(|e| syn::Error::new(e.span(), format!("#[service] goes on a trait: {e}")))?;

    if let Some(span) = generics_span(&item.generics) {
        errors.at(
            span,
            "#[service] traits cannot be generic or have a `where` clause: a service has fixed \
             message types",
        );
    }
    if let Some(u) = &item.unsafety {
        errors.at(u.span, "#[service] traits cannot be `unsafe`");
    }
    if let Some(a) = &item.modifiers.auto_token {
        errors.at(a.span, "#[service] traits cannot be `auto`");
    }

    // Associated stream types first: methods refer to them.
    let streams: Vec<&TraitItemType> = item
        .items
        .iter()
        .filter_map(|i| match i {
            TraitItem::Type(t) => Some(t),
            _ => None,
        })
        .collect();
    let mut methods = Vec::new();
    for it in &item.items {
        match it {
            TraitItem::Fn(f) => {
                let configured = check_cfg(&f.attrs, "method", &mut errors);
                if let Some(m) = check_method(f, &streams, &mut errors)
                    && configured
                {
                    methods.push(m);
                }
            }
            TraitItem::Type(t) => {
                check_cfg(&t.attrs, "stream type", &mut errors);
                if let Some(span) = generics_span(&t.generics) {
                    errors.at(
                        span,
                        "stream types cannot be generic or have a `where` clause",
                    );
                }
                if t.default.is_some() {
                    errors.at(t.ident.span(), "stream types cannot have a default");
                }
            }
            TraitItem::Const(c) => errors.at(
                c.ident.span(),
                "#[service] traits hold `async fn`s and stream types only, not constants",
            ),
            other => errors.at(
                other.span(),
                "#[service] traits hold `async fn`s and stream types only",
            ),
        }
    }
    for t in &streams {
        let used = methods
            .iter()
            .any(|m| m.stream.as_ref().is_some_and(|s| *s == t.ident));
        if !used && stream_item(t).is_some() {
            errors.at(
                t.ident.span(),
                format!(
                    "stream type `{}` is not returned by any method (return \
                     `Result<Self::{}, Status>` from a server-streaming method)",
                    t.ident, t.ident
                ),
            );
        }
    }

    let service = ServiceDef {
        name: item.ident.unraw().to_string(),
        proto_name: item.ident.unraw().to_string(),
        package: args.package.clone(),
        methods: methods
            .iter()
            .map(|m| MethodDef {
                name: m.ident.to_string(),
                proto_name: m.ident.unraw().to_string().to_upper_camel_case(),
                input_type: m.input.clone(),
                output_type: m.output.clone(),
                client_streaming: m.client_streaming,
                server_streaming: m.stream.is_some(),
                docs: without_code_blocks(&m.docs, &format!("{}::{}", item.ident, m.ident.unraw())),
                deprecated: m.deprecated,
                idempotency: m.idempotency,
            })
            .collect(),
        docs: without_code_blocks(&docs(&item.attrs), &item.ident.to_string()),
    };
    let options = EmitOptions {
        crate_path: args.crate_path.clone(),
        build_client: true,
        build_server: true,
        visibility: item.vis.clone(),
        check_messages: true,
    };
    let generated = match rpc_codegen::generate(&service, &options) {
        Ok(tokens) => Some(tokens),
        Err(problems) => {
            for p in problems {
                let span = p
                    .method
                    .and_then(|i| methods.get(i))
                    .map_or(item.ident.span(), |m| m.ident.span());
                errors.at(span, p.message);
            }
            None
        }
    };
    errors.into_result()?;
    let generated = generated.unwrap_or_default();

    let rewritten = rewrite_trait(&item);
    let bridge = bridge(&item, &service, &methods, &args.crate_path)?;
    let generated = with_bridge(generated, &service.server_mod(), bridge)?;
    Ok(quote! {
        #rewritten
        #generated
    })
}

/// Where generics or a `where` clause are written, if any: the parameters' `<..>`, else the
/// `where` clause.
fn generics_span(generics: &syn::Generics) -> Option<Span> {
    if !generics.params.is_empty() {
        Some(generics.params.span())
    } else {
        generics.where_clause.as_ref().map(|w| w.span())
    }
}

/// Refuses `#[cfg]` and `#[cfg_attr]` on a trait item: the generated client, server and method
/// list would still name what the configuration removed. Returns whether there was none.
fn check_cfg(attrs: &[syn::Attribute], what: &str, errors: &mut Errors) -> bool {
    let mut ok = true;
    for a in attrs {
        if a.path().is_ident("cfg") || a.path().is_ident("cfg_attr") {
            ok = false;
            errors.at(
                a.path().span(),
                format!(
                    "`#[cfg]` on a #[service] {what} is not supported: a service has one fixed \
                     set of methods on both sides; put the `#[cfg]` on the whole trait, or move \
                     the method to a service of its own"
                ),
            );
        }
    }
    ok
}

/// Doc lines for the generated items: the trait's, without fenced code blocks (they are doc
/// tests of the trait, and would run once more per generated item); where one was dropped, a
/// line pointing at the trait's item `target`.
fn without_code_blocks(lines: &[String], target: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(lines.len());
    let mut in_code = false;
    let mut dropped = false;
    for line in lines {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_code = !in_code;
            dropped = true;
            continue;
        }
        if !in_code {
            out.push(line.clone());
        }
    }
    if dropped {
        out.push(String::new());
        out.push(format!(" Examples: see [`{target}`](super::{target})."));
    }
    out
}

fn parse_args(attr: TokenStream) -> syn::Result<Args> {
    let mut args = Args {
        package: String::new(),
        crate_path: syn::parse_quote!(::rpc_core),
    };
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("package") {
            let lit: syn::LitStr = meta.value()?.parse()?;
            let package = lit.value();
            let valid = !package.is_empty()
                && package.split('.').all(|part| {
                    part.chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                        && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                });
            if !valid {
                return Err(syn::Error::new(
                    lit.span(),
                    "a package is dot-separated identifiers, like `store.v1`",
                ));
            }
            args.package = package;
            Ok(())
        } else if meta.path.is_ident("crate") {
            let lit: syn::LitStr = meta.value()?.parse()?;
            args.crate_path = lit
                .parse()
                .map_err(|e| syn::Error::new(lit.span(), format!("`crate` must be a path: {e}")))?;
            Ok(())
        } else {
            Err(meta.error(
                "unknown #[service] argument; expected `package = \"..\"` or `crate = \"..\"`",
            ))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;
    Ok(args)
}

fn docs(attrs: &[syn::Attribute]) -> Vec<String> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .filter_map(|a| match &a.meta {
            syn::Meta::NameValue(nv) => match &nv.value {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) => Some(s.value()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn check_method(
    f: &TraitItemFn,
    streams: &[&TraitItemType],
    errors: &mut Errors,
) -> Option<Method> {
    let sig = &f.sig;
    let mut failed = false;
    let fail = |errors: &mut Errors, failed: &mut bool, span: Span, msg: String| {
        *failed = true;
        errors.at(span, msg);
    };
    let example = format!(
        "`async fn {}(&self, request: Message) -> Result<Reply, Status>`",
        sig.ident
    );

    if sig.asyncness.is_none() {
        fail(
            errors,
            &mut failed,
            sig.fn_token.span,
            format!("#[service] methods must be `async fn`: {example}"),
        );
    }
    if let Some(c) = &sig.constness {
        fail(
            errors,
            &mut failed,
            c.span,
            "#[service] methods cannot be `const`".into(),
        );
    }
    if let syn::Safety::Unsafe(u) = &sig.safety {
        fail(
            errors,
            &mut failed,
            u.span,
            "#[service] methods cannot be `unsafe`".into(),
        );
    }
    if let Some(abi) = &sig.abi {
        fail(
            errors,
            &mut failed,
            abi.span(),
            "#[service] methods cannot have an ABI".into(),
        );
    }
    if let Some(span) = generics_span(&sig.generics) {
        fail(
            errors,
            &mut failed,
            span,
            "#[service] methods cannot be generic or have a `where` clause: a method has fixed \
             message types"
                .into(),
        );
    }
    if let Some(v) = &sig.variadic {
        fail(
            errors,
            &mut failed,
            v.span(),
            "#[service] methods cannot be variadic".into(),
        );
    }

    // `&self` and exactly one request.
    match sig.inputs.first() {
        Some(FnArg::Receiver(r)) if matches!(r.kind, syn::ReceiverKind::Reference(_, _, None)) => {}
        Some(FnArg::Receiver(r)) => fail(
            errors,
            &mut failed,
            r.span(),
            format!("#[service] methods take `&self` (the handler is shared): {example}"),
        ),
        _ => fail(
            errors,
            &mut failed,
            sig.paren_token.span.join(),
            format!("#[service] methods take `&self` first: {example}"),
        ),
    }
    let args: Vec<&syn::PatType> = sig
        .inputs
        .iter()
        .filter_map(|a| match a {
            FnArg::Typed(t) => Some(t),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let (input, client_streaming) = match args.as_slice() {
        [arg] => match streaming_inner(&arg.ty) {
            Some(inner) => (message(inner, errors, &mut failed), true),
            None => (message(&arg.ty, errors, &mut failed), false),
        },
        [] => {
            fail(
                errors,
                &mut failed,
                sig.paren_token.span.join(),
                format!("#[service] methods take one request argument: {example}"),
            );
            (syn::parse_quote!(()), false)
        }
        [_, extra, ..] => {
            fail(
                errors,
                &mut failed,
                extra.span(),
                format!("#[service] methods take exactly one request argument: {example}"),
            );
            (syn::parse_quote!(()), false)
        }
    };

    // `Result<Message, Status>` or `Result<Self::Stream, Status>`.
    let (output, stream) = match &sig.output {
        ReturnType::Default => {
            fail(
                errors,
                &mut failed,
                sig.ident.span(),
                format!("#[service] methods return `Result<Reply, Status>`: {example}"),
            );
            (syn::parse_quote!(()), None)
        }
        ReturnType::Type(_, ty) => match result_ok(ty) {
            Err(span) => {
                fail(
                    errors,
                    &mut failed,
                    span,
                    format!("#[service] methods return `Result<Reply, Status>`: {example}"),
                );
                (syn::parse_quote!(()), None)
            }
            Ok(ok) => match self_assoc(ok) {
                Some(name) => match streams.iter().find(|t| t.ident == *name) {
                    Some(t) => match stream_item(t) {
                        Some(item) => (message(item, errors, &mut failed), Some(name.clone())),
                        None => {
                            fail(
                                errors,
                                &mut failed,
                                t.ident.span(),
                                format!(
                                    "stream type `{}` must be bounded by \
                                     `Stream<Item = Result<Message, Status>>`",
                                    t.ident
                                ),
                            );
                            (syn::parse_quote!(()), None)
                        }
                    },
                    None => {
                        fail(
                            errors,
                            &mut failed,
                            ok.span(),
                            format!("`Self::{name}` is not an associated type of this trait"),
                        );
                        (syn::parse_quote!(()), None)
                    }
                },
                None => (message(ok, errors, &mut failed), None),
            },
        },
    };

    let idempotency = rpc_attrs(&f.attrs, errors, &mut failed);
    if failed {
        return None;
    }
    Some(Method {
        ident: sig.ident.clone(),
        input,
        output,
        client_streaming,
        stream,
        docs: docs(&f.attrs),
        deprecated: f.attrs.iter().any(|a| a.path().is_ident("deprecated")),
        idempotency,
    })
}

/// The method's `#[rpc(..)]` options: `idempotent` or `no_side_effects` (protobuf's
/// `idempotency_level`), at most one. Anything else is an error naming what is accepted.
fn rpc_attrs(attrs: &[syn::Attribute], errors: &mut Errors, failed: &mut bool) -> Idempotency {
    const EXPECTED: &str = "expected `idempotent` or `no_side_effects`, as in `#[rpc(idempotent)]`";
    let mut level = Idempotency::Unknown;
    for a in attrs.iter().filter(|a| a.path().is_ident("rpc")) {
        let r = a.parse_nested_meta(|meta| {
            let this = if meta.path.is_ident("idempotent") {
                Idempotency::Idempotent
            } else if meta.path.is_ident("no_side_effects") {
                Idempotency::NoSideEffects
            } else {
                let name = meta
                    .path
                    .get_ident()
                    .map_or_else(|| "..".to_owned(), ToString::to_string);
                return Err(meta.error(format!("unknown #[rpc] option `{name}`; {EXPECTED}")));
            };
            if level != Idempotency::Unknown {
                return Err(meta.error(
                    "a method has one idempotency level: give `idempotent` or \
                     `no_side_effects`, not both",
                ));
            }
            level = this;
            Ok(())
        });
        if let Err(e) = r {
            *failed = true;
            errors.push(e);
        }
    }
    level
}

/// Checks (by shape) that `ty` can be a protobuf message: `()` or a path to a type without
/// generic arguments that is not a well-known non-message.
fn message(ty: &Type, errors: &mut Errors, failed: &mut bool) -> Type {
    const NOT_MESSAGES: &[&str] = &[
        "bool", "char", "str", "i8", "i16", "i32", "i64", "i128", "isize", "u8", "u16", "u32",
        "u64", "u128", "usize", "f32", "f64", "String", "Vec", "Option", "Box", "Result",
        "HashMap", "BTreeMap", "Bytes", "Rc", "Arc", "Self",
    ];
    let ok = match ty {
        Type::Tuple(t) => t.elems.is_empty(),
        Type::Path(p) => {
            p.qself.is_none()
                && p.path
                    .segments
                    .iter()
                    .all(|s| matches!(s.arguments, PathArguments::None))
                && p.path
                    .segments
                    .last()
                    .is_some_and(|s| !NOT_MESSAGES.contains(&s.ident.to_string().as_str()))
                && p.path.segments.first().is_some_and(|s| s.ident != "Self")
        }
        Type::Paren(p) => return message(&p.elem, errors, failed),
        Type::Group(g) => return message(&g.elem, errors, failed),
        _ => false,
    };
    if !ok {
        *failed = true;
        errors.at(
            ty.span(),
            format!(
                "`{}` is not a message: requests and replies are prost messages (a struct \
                 deriving `prost::Message`) or `()`",
                show(ty)
            ),
        );
    }
    ty.clone()
}

/// A type as a user would write it (`Vec<u8>`, not `Vec < u8 >`).
fn show(ty: &Type) -> String {
    let mut s = quote!(#ty).to_string();
    for (from, to) in [
        (" < ", "<"),
        ("< ", "<"),
        (" <", "<"),
        (" >", ">"),
        ("& ", "&"),
        (" :: ", "::"),
        (":: ", "::"),
        (" ,", ","),
    ] {
        s = s.replace(from, to);
    }
    s
}

/// `Streaming<T>` -> `T`.
fn streaming_inner(ty: &Type) -> Option<&Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Streaming" {
        return None;
    }
    single_type_arg(&last.arguments)
}

fn single_type_arg(args: &PathArguments) -> Option<&Type> {
    let PathArguments::AngleBracketed(a) = args else {
        return None;
    };
    let mut types = a.args.iter().filter_map(|g| match g {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    });
    let t = types.next()?;
    types.next().is_none().then_some(t)
}

/// `Result<T, Status>` -> `T`; the error's span otherwise.
fn result_ok(ty: &Type) -> Result<&Type, Span> {
    let Type::Path(p) = ty else {
        return Err(ty.span());
    };
    let last = p.path.segments.last().ok_or(ty.span())?;
    if last.ident != "Result" {
        return Err(ty.span());
    }
    let PathArguments::AngleBracketed(a) = &last.arguments else {
        return Err(ty.span());
    };
    let types: Vec<&Type> = a
        .args
        .iter()
        .filter_map(|g| match g {
            GenericArgument::Type(t) => Some(t),
            _ => None,
        })
        .collect();
    match types.as_slice() {
        [ok, Type::Path(err)]
            if err
                .path
                .segments
                .last()
                .is_some_and(|s| s.ident == "Status") =>
        {
            Ok(ok)
        }
        [_, err] => Err(err.span()),
        _ => Err(ty.span()),
    }
}

/// `Self::Name` -> `Name`.
fn self_assoc(ty: &Type) -> Option<&Ident> {
    let Type::Path(p) = ty else { return None };
    let segs: Vec<_> = p.path.segments.iter().collect();
    match segs.as_slice() {
        [s, name] if p.qself.is_none() && s.ident == "Self" => Some(&name.ident),
        _ => None,
    }
}

/// The message of a stream type's `Stream<Item = Result<Message, _>>` bound.
fn stream_item(t: &TraitItemType) -> Option<&Type> {
    t.bounds.iter().find_map(|b| {
        let TypeParamBound::Trait(tb) = b else {
            return None;
        };
        let last = tb.path.segments.last()?;
        if last.ident != "Stream" {
            return None;
        }
        let PathArguments::AngleBracketed(a) = &last.arguments else {
            return None;
        };
        a.args.iter().find_map(|g| match g {
            GenericArgument::AssocType(at) if at.ident == "Item" => result_ok(&at.ty).ok(),
            _ => None,
        })
    })
}

/// The user's trait with `Send + Sync + 'static` supertraits, `Send + 'static` stream types and
/// `async fn`s as `fn .. -> impl Future + Send`.
fn rewrite_trait(item: &ItemTrait) -> TokenStream {
    let mut item = item.clone();
    item.supertraits
        .push(syn::parse_quote!(::core::marker::Send));
    item.supertraits
        .push(syn::parse_quote!(::core::marker::Sync));
    item.supertraits.push(syn::parse_quote!('static));
    if item.colon_token.is_none() {
        item.colon_token = Some(Default::default());
    }
    for it in &mut item.items {
        match it {
            TraitItem::Type(t) => {
                if t.colon_token.is_none() {
                    t.colon_token = Some(Default::default());
                }
                t.bounds.push(syn::parse_quote!(::core::marker::Send));
                t.bounds.push(syn::parse_quote!('static));
            }
            TraitItem::Fn(f) => {
                // `#[rpc(..)]` is ours (read by `rpc_attrs`), not an attribute rustc knows.
                f.attrs.retain(|a| !a.path().is_ident("rpc"));
                f.sig.asyncness = None;
                let output = match &f.sig.output {
                    ReturnType::Type(_, ty) => quote!(#ty),
                    ReturnType::Default => quote!(()),
                };
                let span = f.sig.ident.span();
                f.sig.output = syn::parse_quote_spanned! {span=>
                    -> impl ::core::future::Future<Output = #output> + ::core::marker::Send
                };
                if let Some(body) = &f.default {
                    let stmts = &body.stmts;
                    f.default = Some(syn::parse_quote_spanned! {span=>
                        { async move { #(#stmts)* } }
                    });
                }
            }
            _ => {}
        }
    }
    quote!(#item)
}

/// `impl<T: Trait> trait_server::Trait for T`: wraps messages in `Request`/`Response`.
/// `impl<T: super::Trait> Trait for T` inside the generated server module: wraps messages in
/// `Request`/`Response`. Inside that module, types are written as the generated code writes
/// them (`super::Msg`), so that a misspelt one is reported there in the same words, once.
fn bridge(
    item: &ItemTrait,
    service: &ServiceDef,
    methods: &[Method],
    krate: &syn::Path,
) -> syn::Result<syn::Item> {
    let user = &item.ident;
    let generated = format_ident!("{}", service.name);
    let t = format_ident!("{}", service.type_param());
    let cg = quote!(#krate::codegen);
    let items = methods.iter().zip(&service.methods).map(|(m, def)| {
        let name = &m.ident;
        let input = rpc_codegen::rebase(&m.input);
        let output = rpc_codegen::rebase(&m.output);
        let request = if m.client_streaming {
            quote!(#cg::Request<#cg::Streaming<#input>>)
        } else {
            quote!(#cg::Request<#input>)
        };
        let span = m.ident.span();
        let body = quote_spanned! {span=>
            let reply = <#t as super::#user>::#name(self, #cg::Request::into_inner(request));
            async move { ::core::result::Result::map(reply.await, #cg::Response::new) }
        };
        match &m.stream {
            Some(stream) => {
                let generated_stream = format_ident!("{}", def.stream_type());
                quote! {
                    type #generated_stream = <#t as super::#user>::#stream;

                    fn #name(
                        &self,
                        request: #request,
                    ) -> impl ::core::future::Future<
                        Output = ::core::result::Result<#cg::Response<Self::#generated_stream>, #cg::Status>,
                    > + ::core::marker::Send {
                        #body
                    }
                }
            }
            None => quote! {
                fn #name(
                    &self,
                    request: #request,
                ) -> impl ::core::future::Future<
                    Output = ::core::result::Result<#cg::Response<#output>, #cg::Status>,
                > + ::core::marker::Send {
                    #body
                }
            },
        }
    });
    let doc = format!(
        " Every [`{user}`](super::{user}) serves as [`{generated}`]: requests and replies are \
         unwrapped and wrapped."
    );
    syn::parse2(quote! {
        #[doc = #doc]
        // Deprecated methods are the user's to call, not the bridge's to warn about.
        #[allow(deprecated)]
        impl<#t: super::#user> #generated for #t {
            #(#items)*
        }
    })
}

/// The generated modules with the bridge added to the server module.
fn with_bridge(
    generated: TokenStream,
    server_mod: &str,
    bridge: syn::Item,
) -> syn::Result<TokenStream> {
    let mut file: syn::File = syn::parse2(generated)?;
    for item in &mut file.items {
        if let syn::Item::Mod(m) = item
            && m.ident == server_mod
            && let Some((_, items)) = &mut m.content
        {
            items.push(bridge);
            break;
        }
    }
    Ok(quote!(#file))
}

#[cfg(test)]
mod tests;
