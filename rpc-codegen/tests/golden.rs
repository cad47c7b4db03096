//! Golden snapshots of generated code, and the errors the front end reports.
//!
//! A snapshot that drifts fails with the first differing line. After reviewing the change,
//! update the snapshots with
//! `UPDATE_GOLDEN=1 cargo test -p rpc-codegen --all-features --test golden`.

use std::path::{Path, PathBuf};

use rpc_codegen::{EmitOptions, MethodDef, ServiceDef};

fn proto_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto")
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// A fresh output directory for one test.
fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("golden")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the output directory");
    dir
}

/// Compares `actual` with the golden file `name`, or rewrites it with `UPDATE_GOLDEN=1`.
fn assert_golden(name: &str, actual: &str) {
    let path = golden_dir().join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(golden_dir()).expect("create tests/golden");
        std::fs::write(&path, actual).expect("write the golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected == actual {
        return;
    }
    let line = expected
        .lines()
        .zip(actual.lines())
        .position(|(e, a)| e != a)
        .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
    panic!(
        "generated code drifted from {}\n  first difference at line {}:\n  golden:    {:?}\n  generated: {:?}\n\
         Review the change, then update the snapshots with\n  \
         UPDATE_GOLDEN=1 cargo test -p rpc-codegen --all-features --test golden",
        path.display(),
        line + 1,
        expected.lines().nth(line).unwrap_or("<end of file>"),
        actual.lines().nth(line).unwrap_or("<end of file>"),
    );
}

fn compile(name: &str, protos: &[&str], builder: rpc_codegen::Builder) -> PathBuf {
    let out = out_dir(name);
    let protos: Vec<PathBuf> = protos.iter().map(|p| proto_dir().join(p)).collect();
    builder
        .out_dir(&out)
        .compile(&protos, &[proto_dir()])
        .expect("compile");
    out
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).expect("generated file")
}

#[test]
fn greeter_snapshot() {
    let out = compile("greeter", &["greeter.proto"], rpc_codegen::configure());
    assert_golden("helloworld.rs", &read(&out, "helloworld.rs"));
}

#[test]
fn all_call_kinds_keywords_and_well_known_types_snapshot() {
    let out = compile(
        "everything",
        &[
            "test/everything.proto",
            "test/nested/deep.proto",
            "test/nopackage.proto",
        ],
        rpc_codegen::configure(),
    );
    assert_golden("test.everything.rs", &read(&out, "test.everything.rs"));
    assert_golden("test.nested.deep.rs", &read(&out, "test.nested.deep.rs"));
    assert_golden("_.rs", &read(&out, "_.rs"));
}

#[test]
fn well_known_types_and_proto2_snapshot() {
    // Well-known types as `::prost_types` paths, `()` and primitives (the wrappers); a proto2
    // group's message (`config::Limits`) as a request.
    let out = compile(
        "wkt_legacy",
        &["test/wkt.proto", "test/legacy.proto"],
        rpc_codegen::configure(),
    );
    assert_golden("test.wkt.rs", &read(&out, "test.wkt.rs"));
    assert_golden("test.legacy.rs", &read(&out, "test.legacy.rs"));
}

#[test]
fn client_only_with_crate_path_snapshot() {
    let out = compile(
        "client_only",
        &["greeter.proto"],
        rpc_codegen::configure()
            .build_server(false)
            .crate_path("::my_reexport::rpc_core"),
    );
    assert_golden("helloworld.client_only.rs", &read(&out, "helloworld.rs"));
}

#[cfg(feature = "tonic")]
#[test]
fn tonic_snapshot() {
    let out = compile(
        "tonic",
        &["greeter.proto"],
        rpc_codegen::configure().emit_tonic(true),
    );
    assert_golden("helloworld.tonic.rs", &read(&out, "helloworld.rs"));
}

#[test]
fn idempotency_levels_snapshot() {
    let out = compile(
        "idempotency",
        &["test/idempotency.proto"],
        rpc_codegen::configure(),
    );
    let code = read(&out, "test.idempotency.rs");
    assert!(
        code.contains(".with_idempotency(::rpc_core::codegen::Idempotency::NoSideEffects)")
            && code.contains(".with_idempotency(::rpc_core::codegen::Idempotency::Idempotent)"),
        "{code}"
    );
    assert_golden("test.idempotency.rs", &code);
}

#[test]
fn emitter_snapshot_from_hand_built_ir() {
    let service = ServiceDef {
        name: "Kv".into(),
        proto_name: "Kv".into(),
        package: "store.v1".into(),
        docs: vec![" A store.".into()],
        methods: vec![
            MethodDef {
                name: "get".into(),
                proto_name: "Get".into(),
                input_type: syn::parse_quote!(crate::msgs::GetRequest),
                output_type: syn::parse_quote!(GetReply),
                client_streaming: false,
                server_streaming: false,
                docs: vec![" Reads a key.".into()],
                deprecated: false,
                idempotency: rpc_codegen::Idempotency::NoSideEffects,
            },
            MethodDef {
                name: "watch".into(),
                proto_name: "Watch".into(),
                input_type: syn::parse_quote!(super::WatchRequest),
                output_type: syn::parse_quote!(::events::Event),
                client_streaming: true,
                server_streaming: true,
                docs: vec![],
                deprecated: true,
                idempotency: rpc_codegen::Idempotency::Unknown,
            },
        ],
    };
    let options = EmitOptions {
        crate_path: syn::parse_quote!(crate::rt),
        visibility: syn::parse_quote!(pub(crate)),
        ..EmitOptions::default()
    };
    let tokens = rpc_codegen::generate(&service, &options).expect("valid service");
    assert_golden(
        "emitter_kv.rs",
        &rpc_codegen::pretty(&tokens).expect("parses"),
    );
}

fn compile_err(name: &str, files: &[(&str, &str)]) -> String {
    let dir = out_dir(name);
    let src = dir.join("src");
    std::fs::create_dir_all(&src).expect("src dir");
    for (file, text) in files {
        std::fs::write(src.join(file), text).expect("write proto");
    }
    let protos: Vec<PathBuf> = files.iter().map(|(f, _)| src.join(f)).collect();
    rpc_codegen::configure()
        .out_dir(dir.join("out"))
        .compile(&protos, &[src])
        .expect_err("must fail")
        .to_string()
}

#[test]
fn syntax_errors_name_file_line_and_column() {
    let e = compile_err(
        "syntax",
        &[(
            "bad.proto",
            "syntax = \"proto3\";\npackage p;\nmessage M {\n  string name = ;\n}\n",
        )],
    );
    assert!(e.contains("bad.proto:4:"), "{e}");
}

#[test]
fn unresolved_imports_are_reported() {
    let e = compile_err(
        "import",
        &[(
            "a.proto",
            "syntax = \"proto3\";\nimport \"missing.proto\";\npackage p;\n",
        )],
    );
    assert!(e.contains("missing.proto"), "{e}");
}

#[test]
fn service_problems_fail_the_build_with_every_reason_at_the_method() {
    let e = compile_err(
        "service",
        &[(
            "s.proto",
            "syntax = \"proto3\";\npackage p;\nmessage M {}\n\
             service Status { rpc Connect(M) returns (M); }\n\
             service S {\n  rpc M794331(M) returns (M);\n  rpc M1219000(M) returns (M);\n\
             rpc Get(M) returns (M);\n  rpc GetBlocking(M) returns (M);\n}\n",
        )],
    );
    assert!(e.contains("2 errors"), "{e}");
    assert!(
        e.contains("`connect` is reserved") && e.contains("--> s.proto:4:22"),
        "{e}"
    );
    assert!(
        e.contains("method ids collide") && e.contains("--> s.proto:7:7"),
        "{e}"
    );
    assert!(e.contains("7 |   rpc M1219000(M) returns (M);"), "{e}");
    assert!(
        !e.contains("runtime name"),
        "a service may be named Status: {e}"
    );
}

#[test]
fn duplicate_definitions_point_at_the_second_one() {
    let dir = out_dir("duplicate_src");
    std::fs::write(
        dir.join("d.proto"),
        "syntax = \"proto3\";\npackage p;\nmessage M {}\nmessage N {}\nmessage M {}\n",
    )
    .unwrap();
    let e = rpc_codegen::configure()
        .out_dir(dir.join("out"))
        .compile(&[dir.join("d.proto")], &[&dir])
        .expect_err("must fail");
    let at = e.problems()[0].location().expect("located");
    assert_eq!(
        (at.file(), at.line(), at.column()),
        ("d.proto", 5, 9),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with("error: name 'p.M' is defined twice\n --> d.proto:5:9\n"),
        "{text}"
    );
    assert!(
        text.contains("5 | message M {}\n  |         ^ defined again here"),
        "{text}"
    );
    assert!(
        text.contains("3 | message M {}"),
        "the first one is a note: {text}"
    );
    // `fn main() -> Result<(), Box<dyn Error>>` prints Debug: the same report.
    assert_eq!(format!("{e:?}"), text);
}

#[test]
fn duplicate_field_numbers_point_at_the_second_field() {
    let e = compile_err(
        "field_numbers",
        &[(
            "f.proto",
            "syntax = \"proto3\";\npackage p;\nmessage M {\n  string a = 1;\n  string b = 2;\n\
             \x20 string c = 1;\n}\n",
        )],
    );
    assert!(e.contains("field number '1' is already used"), "{e}");
    assert!(e.contains("--> f.proto:6:"), "{e}");
    assert!(e.contains("6 |   string c = 1;"), "{e}");
}
