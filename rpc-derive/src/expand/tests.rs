//! The expansion as text: a golden snapshot and the accumulated errors.

use std::path::Path;

use quote::quote;

use super::expand;

fn pretty(tokens: proc_macro2::TokenStream) -> String {
    rpc_codegen::pretty(&tokens).expect("the expansion parses as a file")
}

#[test]
fn expansion_snapshot() {
    let out = expand(
        quote!(package = "kv"),
        quote! {
            /// A key-value store.
            pub trait Kv {
                /// Reads a key.
                #[rpc(no_side_effects)]
                async fn get(&self, request: GetRequest) -> Result<GetReply, Status>;
                /// Stores many keys.
                async fn put_many(&self, request: Streaming<PutRequest>) -> Result<(), Status>;
                /// Changes.
                type Changes: Stream<Item = Result<Change, Status>>;
                /// Watches keys.
                async fn watch(&self, request: GetRequest) -> Result<Self::Changes, Status>;
            }
        },
    );
    let actual = pretty(out);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/kv.rs");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, &actual).expect("write golden");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        expected == actual,
        "the expansion drifted from {}; review, then update with \
         `UPDATE_GOLDEN=1 cargo test -p rpc-derive --lib`\n--- generated ---\n{actual}",
        path.display()
    );
}

#[test]
fn errors_are_accumulated_not_the_first_only() {
    let out = expand(
        quote!(),
        quote! {
            trait Bad<T> {
                fn not_async(&self, r: A) -> Result<B, Status>;
                async fn no_self(r: A) -> Result<B, Status>;
                async fn two(&self, a: A, b: A) -> Result<B, Status>;
                async fn text(&self, r: &str) -> Result<String, Status>;
                async fn no_result(&self, r: A) -> B;
                const X: u32;
            }
        },
    )
    .to_string();
    let count = out.matches("compile_error").count();
    assert_eq!(count, 8, "{out}");
    // The trait is kept so its uses do not fail on their own.
    assert!(out.contains("trait Bad"), "{out}");
}

#[test]
fn non_traits_are_refused_with_a_message() {
    let out = expand(
        quote!(),
        quote!(
            struct S;
        ),
    )
    .to_string();
    assert!(out.contains("#[service] goes on a trait"), "{out}");
}

#[test]
fn doc_tests_stay_on_the_trait_only() {
    let out = pretty(expand(
        quote!(),
        quote! {
            /// A store.
            ///
            /// ```
            /// assert_eq!(1 + 1, 2);
            /// ```
            pub trait Kv {
                /// Reads a key.
                ///
                /// ```
                /// assert!(true);
                /// ```
                async fn get(&self, request: GetRequest) -> Result<GetReply, Status>;
            }
        },
    ));
    // The user's trait keeps its two doc tests; the generated client and server get none.
    assert_eq!(out.matches("/// ```").count(), 4, "{out}");
    assert!(out.contains("Examples: see [`Kv`](super::Kv)."), "{out}");
    assert!(
        out.contains("Examples: see [`Kv::get`](super::Kv::get)."),
        "{out}"
    );
}
