//! `test/legacy.proto`: proto2 defaults, groups and extensions.

use super::*;
use test::legacy::{Config, Holder, Level, config, legacy_client, legacy_server};

pub struct Svc;

impl legacy_server::Legacy for Svc {
    /// Every optional field set to what its accessor reads (its default when unset).
    async fn apply(&self, r: Request<Config>) -> Result<Response<Config>, Status> {
        let c = r.into_inner();
        let limits = c.limits.unwrap_or(config::Limits {
            strict: false,
            ..Default::default()
        });
        Ok(Response::new(Config {
            retries: Some(c.retries()),
            mode: Some(c.mode().to_owned()),
            verbose: Some(c.verbose()),
            ratio: Some(c.ratio()),
            level: Some(c.level() as i32),
            magic: Some(c.magic().to_vec()),
            offset: Some(c.offset()),
            scale: Some(c.scale()),
            limits: Some(config::Limits {
                max_calls: Some(limits.max_calls()),
                max_bytes: Some(limits.max_bytes()),
                strict: limits.strict,
            }),
            rule: c
                .rule
                .iter()
                .map(|r| config::Rule {
                    pattern: r.pattern.clone(),
                    allow: Some(r.allow()),
                    window: r.window.as_ref().map(|w| config::rule::Window {
                        from: Some(w.from()),
                        to: Some(w.to()),
                    }),
                })
                .collect(),
            ..c
        }))
    }

    async fn tighten(
        &self,
        r: Request<config::Limits>,
    ) -> Result<Response<config::Limits>, Status> {
        let l = r.into_inner();
        Ok(Response::new(config::Limits {
            max_calls: Some(l.max_calls() / 2),
            max_bytes: l.max_bytes,
            strict: true,
        }))
    }

    async fn wrap(&self, r: Request<Config>) -> Result<Response<Holder>, Status> {
        Ok(Response::new(Holder {
            note: None,
            config: Some(r.into_inner()),
        }))
    }
}

#[tokio::test]
async fn proto2_defaults_groups_and_extensions_are_served_and_called() {
    let server = Server::builder().add_service(legacy_server::LegacyServer::new(Svc));
    with_server(server, |channel| async move {
        let client = legacy_client::LegacyClient::new(channel);
        let sent = Config {
            name: "edge".into(),
            ports: vec![80, 443],
            hosts: vec!["a".into()],
            rule: vec![
                config::Rule {
                    pattern: "/admin".into(),
                    allow: Some(false),
                    window: Some(config::rule::Window {
                        from: Some(8),
                        to: None,
                    }),
                },
                config::Rule {
                    pattern: "/".into(),
                    ..Default::default()
                },
            ],
            ..Config::default()
        };
        // Unset on the wire: the accessors read the declared defaults.
        assert_eq!((sent.retries, sent.retries()), (None, 3));
        let c = client.apply(sent).await.unwrap().into_inner();
        assert_eq!(c.name, "edge");
        assert_eq!(c.retries, Some(3));
        assert_eq!(c.mode.as_deref(), Some("fast"));
        assert_eq!(c.verbose, Some(true));
        assert_eq!(c.ratio, Some(0.25));
        assert_eq!(c.level, Some(Level::High as i32));
        assert_eq!(c.level(), Level::High);
        assert_eq!(c.magic.as_deref(), Some(&b"\x01\x02z"[..]));
        assert_eq!(c.offset, Some(-40));
        assert_eq!(c.scale, Some(f32::INFINITY));
        assert_eq!(c.ports, [80, 443]);
        assert_eq!(c.hosts, ["a"]);
        // The optional group, filled with its defaults, and the repeated group.
        assert_eq!(
            c.limits,
            Some(config::Limits {
                max_calls: Some(100),
                max_bytes: Some(0),
                strict: false,
            })
        );
        assert_eq!(c.rule.len(), 2);
        assert_eq!(c.rule[0].allow, Some(false));
        assert_eq!(
            c.rule[0].window,
            Some(config::rule::Window {
                from: Some(8),
                to: Some(60),
            })
        );
        assert_eq!(
            (c.rule[1].pattern.as_str(), c.rule[1].allow),
            ("/", Some(true))
        );
        assert_eq!(c.rule[1].window, None);

        // A group's message as the request and response.
        let l = client
            .tighten(config::Limits {
                max_calls: None,
                max_bytes: Some(1 << 20),
                strict: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            l,
            config::Limits {
                max_calls: Some(50),
                max_bytes: Some(1 << 20),
                strict: true,
            }
        );

        let h = client
            .wrap(Config {
                name: "inner".into(),
                retries: Some(9),
                ..Config::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((h.note.as_deref(), h.note()), (None, "none"));
        let inner = h.config.unwrap();
        assert_eq!((inner.name.as_str(), inner.retries()), ("inner", 9));
    })
    .await;
}

#[test]
fn proto2_extensions_on_the_wire_are_skipped() {
    // A `Config` carrying extension 100 (`owner`, a string) and 101 (`tags`): prost generates
    // nothing for extensions, and decoding skips their fields as unknown ones.
    let mut bytes = test::legacy::Config {
        name: "x".into(),
        ..Default::default()
    }
    .encode_to_vec();
    bytes.extend_from_slice(&[0xa2, 0x06, 0x03, b'b', b'o', b'b']); // field 100, length 3
    bytes.extend_from_slice(&[0xa8, 0x06, 0x07]); // field 101, varint 7
    let c = test::legacy::Config::decode(bytes.as_slice()).expect("extensions are skipped");
    assert_eq!(c.name, "x");
    assert_eq!(c.encode_to_vec().len(), 3, "unknown fields are not kept");
}
