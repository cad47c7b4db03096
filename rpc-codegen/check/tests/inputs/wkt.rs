//! `test/wkt.proto`: every well-known type as a request, a response and a field.

use super::*;
use test::wkt::{Envelope, Reading, envelope, well_known_client, well_known_server};

pub const READING_URL: &str = "type.googleapis.com/test.wkt.Reading";

pub fn pack(reading: &Reading) -> Any {
    Any {
        type_url: READING_URL.into(),
        value: reading.encode_to_vec(),
    }
}

/// The `Reading` in `any`, refused with `INVALID_ARGUMENT` when it holds something else or
/// does not decode (the bytes come from the peer).
pub fn unpack(any: &Any) -> Result<Reading, Status> {
    if any.type_url != READING_URL {
        return Err(Status::invalid_argument(format!(
            "expected a Reading, got `{}`",
            any.type_url
        )));
    }
    Reading::decode(any.value.as_slice())
        .map_err(|e| Status::invalid_argument(format!("not a Reading: {e}")))
}

pub fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

pub fn number(n: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(n)),
    }
}

/// Doubles numbers, measures strings, counts lists, lists a struct's keys, negates bools
/// and names null.
pub fn evaluate(v: Value) -> Value {
    let kind = match v.kind {
        Some(Kind::NumberValue(n)) => Kind::NumberValue(n * 2.0),
        Some(Kind::StringValue(s)) => Kind::NumberValue(s.chars().count() as f64),
        Some(Kind::ListValue(l)) => Kind::NumberValue(l.values.len() as f64),
        Some(Kind::StructValue(s)) => Kind::ListValue(ListValue {
            values: s.fields.keys().map(|k| string(k)).collect(),
        }),
        Some(Kind::BoolValue(b)) => Kind::BoolValue(!b),
        Some(Kind::NullValue(_)) | None => Kind::StringValue("null".into()),
    };
    Value { kind: Some(kind) }
}

pub struct Svc;

impl well_known_server::WellKnown for Svc {
    async fn forward(&self, r: Request<Envelope>) -> Result<Response<Envelope>, Status> {
        let mut e = r.into_inner();
        let payload = e
            .payload
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("no payload"))?;
        let mut reading = unpack(payload)?;
        reading.celsius += 1.5;
        e.payload = Some(pack(&reading));
        e.attachments.reverse();
        e.attributes
            .get_or_insert_with(Struct::default)
            .fields
            .insert(
                "seen".into(),
                Value {
                    kind: Some(Kind::BoolValue(true)),
                },
            );
        e.value = e.value.map(evaluate);
        e.items
            .get_or_insert_with(ListValue::default)
            .values
            .push(string("tail"));
        if let (Some(at), Some(ttl)) = (e.sent_at, e.ttl) {
            e.history.push(prost_types::Timestamp {
                seconds: at.seconds + ttl.seconds,
                nanos: at.nanos + ttl.nanos,
            });
        }
        if let Some(mask) = &mut e.mask {
            mask.paths.sort();
        }
        e.label = e.label.map(|l| l.to_uppercase());
        e.count = e.count.map(|c| c + 1);
        e.urgent = e.urgent.map(|u| !u);
        if let Some(sum) = &mut e.checksum {
            sum.reverse();
        }
        e.weight = e.weight.map(|w| w * 2.0);
        e.hops = Some(e.hops.unwrap_or(0) + 1);
        e.fields
            .insert("count".into(), number(e.count.unwrap_or(0) as f64));
        e.extra = match e.extra {
            Some(envelope::Extra::Note(s)) => Some(envelope::Extra::Delay(prost_types::Duration {
                seconds: s.fields.len() as i64,
                nanos: 0,
            })),
            other => other,
        };
        Ok(Response::new(e))
    }

    async fn unpack(&self, r: Request<Any>) -> Result<Response<Any>, Status> {
        let mut reading = unpack(r.get_ref())?;
        reading.sensor = reading.sensor.to_uppercase();
        Ok(Response::new(pack(&reading)))
    }

    async fn merge(&self, r: Request<Struct>) -> Result<Response<Struct>, Status> {
        let mut s = r.into_inner();
        let n = s.fields.len() as f64;
        s.fields.insert("fields".into(), number(n));
        s.fields.insert(
            "merged".into(),
            Value {
                kind: Some(Kind::BoolValue(true)),
            },
        );
        Ok(Response::new(s))
    }

    async fn evaluate(&self, r: Request<Value>) -> Result<Response<Value>, Status> {
        Ok(Response::new(evaluate(r.into_inner())))
    }

    async fn reverse(&self, r: Request<ListValue>) -> Result<Response<ListValue>, Status> {
        let mut l = r.into_inner();
        l.values.reverse();
        Ok(Response::new(l))
    }

    async fn after(
        &self,
        r: Request<prost_types::Duration>,
    ) -> Result<Response<prost_types::Timestamp>, Status> {
        let d = r.into_inner();
        Ok(Response::new(prost_types::Timestamp {
            seconds: 1_700_000_000 + d.seconds,
            nanos: d.nanos,
        }))
    }

    async fn paths(
        &self,
        r: Request<prost_types::FieldMask>,
    ) -> Result<Response<prost_types::FieldMask>, Status> {
        let mut m = r.into_inner();
        m.paths.sort();
        m.paths.dedup();
        Ok(Response::new(m))
    }

    async fn length(&self, r: Request<String>) -> Result<Response<i64>, Status> {
        Ok(Response::new(r.get_ref().chars().count() as i64))
    }

    async fn negate(&self, r: Request<bool>) -> Result<Response<bool>, Status> {
        Ok(Response::new(!r.into_inner()))
    }

    async fn sum(&self, r: Request<Vec<u8>>) -> Result<Response<u64>, Status> {
        Ok(Response::new(
            r.get_ref().iter().map(|&b| u64::from(b)).sum(),
        ))
    }

    async fn halve(&self, r: Request<f64>) -> Result<Response<f32>, Status> {
        Ok(Response::new((r.into_inner() / 2.0) as f32))
    }

    async fn widen(&self, r: Request<i32>) -> Result<Response<u32>, Status> {
        Ok(Response::new(r.into_inner().unsigned_abs()))
    }

    async fn nothing(&self, _: Request<()>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }

    type SpreadStream = Iter<Value>;

    async fn spread(&self, r: Request<ListValue>) -> Result<Response<Iter<Value>>, Status> {
        Ok(Response::new(Iter::new(r.into_inner().values)))
    }
}

#[tokio::test]
async fn well_known_types_are_served_and_called() {
    let server = Server::builder().add_service(well_known_server::WellKnownServer::new(Svc));
    with_server(server, |channel| async move {
        let client = well_known_client::WellKnownClient::new(channel);
        let reading = Reading {
            sensor: "probe-1".into(),
            celsius: 20.0,
        };

        // Any: packed, sent, unpacked and repacked by the handler.
        let any = client.unpack(pack(&reading)).await.unwrap().into_inner();
        assert_eq!(any.type_url, READING_URL);
        let back = Reading::decode(any.value.as_slice()).unwrap();
        assert_eq!((back.sensor.as_str(), back.celsius), ("PROBE-1", 20.0));
        // An Any of another type is refused by the handler, not a panic.
        let err = client
            .unpack(Any {
                type_url: "type.googleapis.com/test.wkt.Envelope".into(),
                value: vec![0xff, 0xff],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        let err = client
            .unpack(Any {
                type_url: READING_URL.into(),
                value: vec![0x0a, 0x05, b'a'],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("not a Reading"), "{err:?}");

        // Struct, Value, ListValue.
        let s = Struct {
            fields: BTreeMap::from([("a".into(), number(1.0)), ("b".into(), string("x"))]),
        };
        let merged = client.merge(s).await.unwrap().into_inner();
        assert_eq!(merged.fields.len(), 4);
        assert_eq!(merged.fields["fields"], number(2.0));
        assert_eq!(merged.fields["b"], string("x"));
        assert_eq!(merged.fields["merged"].kind, Some(Kind::BoolValue(true)));
        let evaluated = |v: Value| {
            let client = client.clone();
            async move { client.evaluate(v).await.unwrap().into_inner() }
        };
        assert_eq!(evaluated(number(21.0)).await, number(42.0));
        assert_eq!(evaluated(string("héllo")).await, number(5.0));
        assert_eq!(
            evaluated(Value {
                kind: Some(Kind::NullValue(0)),
            })
            .await,
            string("null")
        );
        let nested = Value {
            kind: Some(Kind::StructValue(Struct {
                fields: BTreeMap::from([
                    ("k".into(), Value::default()),
                    ("j".into(), Value::default()),
                ]),
            })),
        };
        assert_eq!(
            evaluated(nested).await.kind,
            Some(Kind::ListValue(ListValue {
                values: vec![string("j"), string("k")],
            }))
        );
        let list = ListValue {
            values: vec![number(1.0), string("two"), Value::default()],
        };
        let reversed = client.reverse(list.clone()).await.unwrap().into_inner();
        assert_eq!(
            reversed.values,
            [Value::default(), string("two"), number(1.0)]
        );
        // Server streaming of Values.
        let spread = collect(client.spread(list.clone()).await.unwrap()).await;
        assert_eq!(spread, list.values);

        // Time, masks, wrappers, Empty.
        let at = client
            .after(prost_types::Duration {
                seconds: 60,
                nanos: 5,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((at.seconds, at.nanos), (1_700_000_060, 5));
        let mask = client
            .paths(prost_types::FieldMask {
                paths: vec!["b.c".into(), "a".into(), "b.c".into()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(mask.paths, ["a", "b.c"]);
        assert_eq!(
            client
                .length(String::from("wrappers"))
                .await
                .unwrap()
                .into_inner(),
            8
        );
        assert!(!client.negate(true).await.unwrap().into_inner());
        assert_eq!(
            client.sum(vec![1u8, 2, 250]).await.unwrap().into_inner(),
            253
        );
        assert_eq!(client.halve(5.0).await.unwrap().into_inner(), 2.5f32);
        assert_eq!(client.widen(-7).await.unwrap().into_inner(), 7u32);
        client.nothing(()).await.unwrap();

        // A message with a field of every well-known type.
        let note = Struct {
            fields: BTreeMap::from([("x".into(), number(1.0)), ("y".into(), number(2.0))]),
        };
        let envelope = Envelope {
            payload: Some(pack(&reading)),
            attachments: vec![
                pack(&Reading {
                    sensor: "first".into(),
                    celsius: 1.0,
                }),
                Any {
                    type_url: "type.example/opaque".into(),
                    value: vec![1, 2, 3],
                },
            ],
            attributes: None,
            value: Some(number(4.0)),
            items: Some(ListValue {
                values: vec![string("head")],
            }),
            sent_at: Some(prost_types::Timestamp {
                seconds: 100,
                nanos: 1,
            }),
            ttl: Some(prost_types::Duration {
                seconds: 20,
                nanos: 2,
            }),
            mask: Some(prost_types::FieldMask {
                paths: vec!["z".into(), "y".into()],
            }),
            nothing: Some(()),
            null: prost_types::NullValue::NullValue as i32,
            label: Some("urgent mail".into()),
            count: Some(41),
            urgent: Some(false),
            checksum: Some(vec![1, 2, 3]),
            weight: Some(0.75),
            hops: None,
            fields: HashMap::from([("keep".into(), string("me"))]),
            history: vec![],
            extra: Some(envelope::Extra::Note(note)),
        };
        let e = client.forward(envelope).await.unwrap().into_inner();
        let payload = unpack(e.payload.as_ref().unwrap()).unwrap();
        assert_eq!(
            (payload.sensor.as_str(), payload.celsius),
            ("probe-1", 21.5)
        );
        assert_eq!(e.attachments.len(), 2);
        assert_eq!(e.attachments[0].type_url, "type.example/opaque");
        assert_eq!(e.attachments[0].value, [1, 2, 3]);
        assert_eq!(
            unpack(&e.attachments[1]).unwrap().sensor,
            "first",
            "{:?}",
            e.attachments
        );
        assert_eq!(
            e.attributes.unwrap().fields["seen"].kind,
            Some(Kind::BoolValue(true))
        );
        assert_eq!(e.value, Some(number(8.0)));
        assert_eq!(e.items.unwrap().values, [string("head"), string("tail")]);
        assert_eq!(
            e.history,
            [prost_types::Timestamp {
                seconds: 120,
                nanos: 3
            }]
        );
        assert_eq!(e.mask.unwrap().paths, ["y", "z"]);
        assert_eq!(e.nothing, Some(()));
        assert_eq!(e.null, 0);
        assert_eq!(e.label.as_deref(), Some("URGENT MAIL"));
        assert_eq!(e.count, Some(42));
        assert_eq!(e.urgent, Some(true));
        assert_eq!(e.checksum.as_deref(), Some(&[3u8, 2, 1][..]));
        assert_eq!(e.weight, Some(1.5));
        assert_eq!(e.hops, Some(1));
        assert_eq!(e.fields.len(), 2);
        assert_eq!(e.fields["keep"], string("me"));
        assert_eq!(e.fields["count"], number(42.0));
        assert_eq!(
            e.extra,
            Some(envelope::Extra::Delay(prost_types::Duration {
                seconds: 2,
                nanos: 0
            }))
        );
    })
    .await;
}
