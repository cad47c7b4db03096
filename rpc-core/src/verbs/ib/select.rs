//! Pure selection logic of the `ib` provider: which devices and ports to use (`RPC_IB_HCA`),
//! which GID (`RPC_IB_GID_INDEX`, automatic RoCE v2 choice), which MTU. Nothing here touches a
//! device, so it is all tested on any host.

use std::fmt;
use std::net::Ipv4Addr;

use crate::verbs::error::{ErrorKind, Verb, VerbsError};

/// The environment variable listing the devices (and ports) to use, NCCL_IB_HCA-style.
pub const ENV_HCA: &str = "RPC_IB_HCA";
/// The environment variable forcing a GID index (RoCE).
pub const ENV_GID_INDEX: &str = "RPC_IB_GID_INDEX";
/// The environment variable asking for several QPs per connection.
pub const ENV_QPS_PER_CONNECTION: &str = "RPC_IB_QPS_PER_CONNECTION";
/// The environment variable setting the traffic class (RoCE: DSCP << 2 | ECN) of our packets.
pub const ENV_TC: &str = "RPC_IB_TC";
/// The environment variable setting the service level of our packets.
pub const ENV_SL: &str = "RPC_IB_SL";
/// The environment variable setting the local ACK timeout of our QPs (verbs encoding:
/// 4.096 µs * 2^n, NCCL_IB_TIMEOUT-style), for fabrics or hosts slower than the default's
/// 67 ms allows (an emulated VM, a congested network).
pub const ENV_TIMEOUT: &str = "RPC_IB_TIMEOUT";
/// The environment variable setting the transport retry count of our QPs (0..=7,
/// NCCL_IB_RETRY_CNT-style).
pub const ENV_RETRY_CNT: &str = "RPC_IB_RETRY_CNT";

/// Most QPs one connection may be striped over.
pub const MAX_QPS_PER_CONNECTION: u32 = crate::verbs::MAX_QPS_PER_CONNECTION;

/// One entry of an `RPC_IB_HCA` list: a device name (or prefix) and an optional port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaEntry {
    /// Device name, or a prefix of it unless the list is exact.
    pub name: String,
    /// Port number (1-based); `None` means every active port.
    pub port: Option<u8>,
}

/// A parsed `RPC_IB_HCA` value, with NCCL_IB_HCA's syntax:
///
/// - `mlx5_0:1,mlx5_1` - use these devices (a missing port means every active port), in this
///   order; names are prefixes (`mlx5` matches `mlx5_0` and `mlx5_1`);
/// - a leading `=` makes names exact (`=mlx5_1` does not match `mlx5_10`);
/// - a leading `^` excludes the listed devices and keeps every other one (`^=mlx5_3`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct HcaSpec {
    /// The entries, in the order given.
    pub entries: Vec<HcaEntry>,
    /// Whether the entries are excluded rather than selected.
    pub exclude: bool,
    /// Whether names must match exactly rather than as prefixes.
    pub exact: bool,
}

impl HcaSpec {
    /// Parses an `RPC_IB_HCA` value. An empty value selects every device.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an empty name or a port that is not a number in
    /// 1..=255, with the offending entry in the message.
    pub fn parse(s: &str) -> Result<HcaSpec, VerbsError> {
        let mut rest = s.trim();
        let mut spec = HcaSpec::default();
        if let Some(r) = rest.strip_prefix('^') {
            spec.exclude = true;
            rest = r;
        }
        if let Some(r) = rest.strip_prefix('=') {
            spec.exact = true;
            rest = r;
        }
        for item in rest.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, port) =
                match item.split_once(':') {
                    Some((n, p)) => {
                        let port = p.trim().parse::<u8>().ok().filter(|&p| p != 0).ok_or_else(
                            || {
                                bad_env(format!(
                                    "{ENV_HCA}: entry `{item}` has a bad port (want a number in \
                                 1..=255, e.g. `mlx5_0:1`)"
                                ))
                            },
                        )?;
                        (n.trim(), Some(port))
                    }
                    None => (item, None),
                };
            if name.is_empty() {
                return Err(bad_env(format!(
                    "{ENV_HCA}: entry `{item}` has no device name (want e.g. `mlx5_0:1,mlx5_1`)"
                )));
            }
            spec.entries.push(HcaEntry {
                name: name.to_owned(),
                port,
            });
        }
        Ok(spec)
    }

    /// Whether the spec selects every device (no entries).
    pub fn is_all(&self) -> bool {
        self.entries.is_empty()
    }

    fn name_matches(&self, want: &str, name: &str) -> bool {
        if self.exact {
            want == name
        } else {
            name.starts_with(want)
        }
    }

    /// Filters and orders the available `(device, port)` pairs (already restricted to active
    /// ports, in device-list order) by this spec.
    ///
    /// Selection keeps the spec's order (rails are numbered as listed); exclusion keeps the
    /// device-list order. A pair is never listed twice.
    pub fn select<'a>(&self, available: &'a [(String, u8)]) -> Vec<&'a (String, u8)> {
        let hit = |e: &HcaEntry, (name, port): &(String, u8)| {
            self.name_matches(&e.name, name) && e.port.is_none_or(|p| p == *port)
        };
        if self.is_all() {
            return available.iter().collect();
        }
        if self.exclude {
            return available
                .iter()
                .filter(|a| !self.entries.iter().any(|e| hit(e, a)))
                .collect();
        }
        let mut out: Vec<&(String, u8)> = Vec::new();
        for e in &self.entries {
            for a in available {
                if hit(e, a) && !out.contains(&a) {
                    out.push(a);
                }
            }
        }
        out
    }
}

impl fmt::Display for HcaSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exclude {
            f.write_str("^")?;
        }
        if self.exact {
            f.write_str("=")?;
        }
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(&e.name)?;
            if let Some(p) = e.port {
                write!(f, ":{p}")?;
            }
        }
        Ok(())
    }
}

fn bad_env(msg: String) -> VerbsError {
    VerbsError::new(Verb::OpenDevice, ErrorKind::InvalidArgument, msg)
}

/// Reads an optional numeric environment variable.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] when it is set but not a number in `0..=max`.
pub fn env_number(name: &str, max: u32) -> Result<Option<u32>, VerbsError> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&n| n <= max)
            .map(Some)
            .ok_or_else(|| bad_env(format!("{name}={v:?} is not a number in 0..={max}"))),
    }
}

/// The kind of a GID table entry, as `gid_attrs/types/<index>` in sysfs names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GidKind {
    /// InfiniBand GID, or RoCE v1 (the kernel prints both as `IB/RoCE v1`).
    IbRoceV1,
    /// RoCE v2 (routable, UDP port 4791).
    RoceV2,
    /// The type could not be read.
    Unknown,
}

impl GidKind {
    /// From the contents of `/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/types/<index>`.
    pub fn from_sysfs(s: &str) -> GidKind {
        match s.trim() {
            "RoCE v2" => GidKind::RoceV2,
            "IB/RoCE v1" | "RoCE v1" | "IB" => GidKind::IbRoceV1,
            _ => GidKind::Unknown,
        }
    }

    /// Short name for logs and `rpc-doctor`.
    pub const fn name(self) -> &'static str {
        match self {
            GidKind::IbRoceV1 => "IB/RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
            GidKind::Unknown => "unknown",
        }
    }
}

/// One non-empty entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (what `sgid_index` names).
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// RoCE version.
    pub kind: GidKind,
    /// The network device the GID belongs to (RoCE), from `gid_attrs/ndevs`.
    pub netdev: Option<String>,
}

impl GidEntry {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        ipv4_mapped(&self.gid)
    }

    /// Whether the GID is an IPv6 link-local address (`fe80::/10`).
    pub fn is_link_local(&self) -> bool {
        self.gid[0] == 0xfe && self.gid[1] & 0xc0 == 0x80
    }

    /// How good a choice for RoCE this entry is; higher is better, `None` is unusable.
    ///
    /// The order follows NCCL's defaults (RoCE v2, IPv4): IPv4-mapped RoCE v2, then global
    /// IPv6 RoCE v2, then link-local RoCE v2 (only reachable on one L2 segment), then RoCE v1.
    pub fn roce_rank(&self) -> Option<u8> {
        if self.gid == [0; 16] {
            return None;
        }
        let v4 = self.ipv4().is_some();
        Some(match (self.kind, v4, self.is_link_local()) {
            (GidKind::RoceV2, true, _) => 6,
            (GidKind::RoceV2, false, false) => 5,
            (GidKind::RoceV2, false, true) => 4,
            (GidKind::Unknown, true, _) => 3,
            (GidKind::Unknown, false, _) => 2,
            (GidKind::IbRoceV1, _, _) => 1,
        })
    }
}

/// The IPv4 address inside an IPv4-mapped IPv6 GID.
pub fn ipv4_mapped(gid: &[u8; 16]) -> Option<Ipv4Addr> {
    if gid[..10] == [0; 10] && gid[10] == 0xff && gid[11] == 0xff {
        Some(Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15]))
    } else {
        None
    }
}

/// Formats a GID as an IPv6 address (`::ffff:192.0.2.1`, `fe80::1`), like `show_gids`.
#[derive(Debug)]
pub struct GidAddr<'a>(pub &'a [u8; 16]);

impl fmt::Display for GidAddr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(v4) = ipv4_mapped(self.0) {
            return write!(f, "::ffff:{v4}");
        }
        write!(f, "{}", std::net::Ipv6Addr::from(*self.0))
    }
}

/// Why a GID was chosen (for the log line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidChoice {
    /// `RPC_IB_GID_INDEX` named it.
    Forced,
    /// The automatic RoCE choice.
    Auto,
    /// InfiniBand: index 0 (the port GID: subnet prefix + port GUID).
    InfiniBand,
}

/// Chooses the GID of a port.
///
/// - `forced` (from `RPC_IB_GID_INDEX`): that index, which must exist in `table`;
/// - InfiniBand link layer: index 0;
/// - RoCE: the best [`GidEntry::roce_rank`], lowest index among equals.
///
/// # Errors
/// [`ErrorKind::NoDevice`] when a RoCE port has no usable GID (no IP address on its netdev)
/// or the forced index is not in the table.
pub fn choose_gid(
    dev: &str,
    port: u8,
    ethernet: bool,
    table: &[GidEntry],
    forced: Option<u32>,
) -> Result<(GidEntry, GidChoice), VerbsError> {
    if let Some(idx) = forced {
        return match table.iter().find(|g| g.index == idx) {
            Some(g) => Ok((g.clone(), GidChoice::Forced)),
            None => Err(VerbsError::new(
                Verb::QueryDevice,
                ErrorKind::NoDevice,
                format!(
                    "{ENV_GID_INDEX}={idx}: {dev}:{port} has no GID at index {idx} (valid: {}); \
                     run rpc-doctor or `show_gids` to list them, or unset {ENV_GID_INDEX} for \
                     the automatic RoCE v2 choice",
                    list_indices(table)
                ),
            )),
        };
    }
    if !ethernet {
        let g = table
            .iter()
            .find(|g| g.index == 0)
            .cloned()
            .unwrap_or(GidEntry {
                index: 0,
                gid: [0; 16],
                kind: GidKind::IbRoceV1,
                netdev: None,
            });
        return Ok((g, GidChoice::InfiniBand));
    }
    let mut best: Option<(&GidEntry, u8)> = None;
    for g in table {
        if let Some(r) = g.roce_rank()
            && best.is_none_or(|(_, br)| r > br)
        {
            best = Some((g, r));
        }
    }
    match best {
        Some((g, _)) => Ok((g.clone(), GidChoice::Auto)),
        None => Err(VerbsError::new(
            Verb::QueryDevice,
            ErrorKind::NoDevice,
            format!(
                "{dev}:{port} is a RoCE port with an empty GID table: its network device has \
                 no IP address (assign one, e.g. `ip addr add 192.0.2.1/24 dev <netdev>`), \
                 then retry"
            ),
        )),
    }
}

fn list_indices(table: &[GidEntry]) -> String {
    if table.is_empty() {
        return "none".to_owned();
    }
    let v: Vec<String> = table.iter().map(|g| g.index.to_string()).collect();
    v.join(", ")
}

/// The verbs MTU encoding (`IBV_MTU_256` = 1 .. `IBV_MTU_4096` = 5) of a byte count, rounded
/// down to a valid MTU; `None` below 256.
pub const fn mtu_enum(bytes: u32) -> Option<u32> {
    match bytes {
        4096.. => Some(5),
        2048.. => Some(4),
        1024.. => Some(3),
        512.. => Some(2),
        256.. => Some(1),
        _ => None,
    }
}

/// The byte count of a verbs MTU encoding; `None` for an invalid encoding.
pub const fn mtu_bytes(e: u32) -> Option<u32> {
    match e {
        1..=5 => Some(128 << e),
        _ => None,
    }
}

/// The path MTU of a connection: the minimum of our port's active MTU, the peer's and the
/// wanted one, rounded down to a verbs MTU.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] when the minimum is below 256 bytes.
pub fn path_mtu(local: u32, remote: u32, wanted: u32) -> Result<u32, VerbsError> {
    let m = local.min(remote).min(wanted);
    mtu_enum(m).and_then(mtu_bytes).ok_or_else(|| {
        VerbsError::new(
            Verb::ModifyQp,
            ErrorKind::InvalidArgument,
            format!(
                "path MTU {m} is below 256 bytes (ours {local}, peer {remote}, wanted {wanted})"
            ),
        )
    })
}

/// The rail (index into the opened devices) of shard `shard` among `n` rails: `shard mod n`.
pub const fn rail_of(shard: usize, n: usize) -> usize {
    if n == 0 { 0 } else { shard % n }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avail(list: &[(&str, u8)]) -> Vec<(String, u8)> {
        list.iter().map(|(n, p)| (n.to_string(), *p)).collect()
    }

    fn names(v: Vec<&(String, u8)>) -> Vec<String> {
        v.into_iter().map(|(n, p)| format!("{n}:{p}")).collect()
    }

    #[test]
    fn hca_parse_forms() {
        let s = HcaSpec::parse("mlx5_0:1, mlx5_1").unwrap();
        assert!(!s.exclude && !s.exact);
        assert_eq!(
            s.entries,
            vec![
                HcaEntry {
                    name: "mlx5_0".into(),
                    port: Some(1)
                },
                HcaEntry {
                    name: "mlx5_1".into(),
                    port: None
                }
            ]
        );
        assert_eq!(s.to_string(), "mlx5_0:1,mlx5_1");
        let s = HcaSpec::parse("^=mlx5_3").unwrap();
        assert!(s.exclude && s.exact);
        assert_eq!(s.to_string(), "^=mlx5_3");
        assert!(HcaSpec::parse("").unwrap().is_all());
        assert!(HcaSpec::parse(" , ").unwrap().is_all());
    }

    #[test]
    fn hca_parse_errors_name_the_entry() {
        for bad in ["mlx5_0:x", "mlx5_0:0", "mlx5_0:256", ":1"] {
            let e = HcaSpec::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}");
            assert!(e.to_string().contains(ENV_HCA), "{e}");
        }
    }

    #[test]
    fn hca_select_orders_and_filters() {
        let a = avail(&[
            ("mlx5_0", 1),
            ("mlx5_0", 2),
            ("mlx5_1", 1),
            ("mlx5_10", 1),
            ("rxe0", 1),
        ]);
        let s = HcaSpec::parse("rxe0,mlx5_0:2").unwrap();
        assert_eq!(names(s.select(&a)), ["rxe0:1", "mlx5_0:2"]);
        // prefix matching, and no duplicates
        let s = HcaSpec::parse("mlx5_1,mlx5").unwrap();
        assert_eq!(
            names(s.select(&a)),
            ["mlx5_1:1", "mlx5_10:1", "mlx5_0:1", "mlx5_0:2"]
        );
        let s = HcaSpec::parse("=mlx5_1").unwrap();
        assert_eq!(names(s.select(&a)), ["mlx5_1:1"]);
        let s = HcaSpec::parse("^mlx5").unwrap();
        assert_eq!(names(s.select(&a)), ["rxe0:1"]);
        let s = HcaSpec::parse("^=mlx5_0:1").unwrap();
        assert_eq!(
            names(s.select(&a)),
            ["mlx5_0:2", "mlx5_1:1", "mlx5_10:1", "rxe0:1"]
        );
        assert_eq!(HcaSpec::default().select(&a).len(), 5);
        assert!(HcaSpec::parse("nope").unwrap().select(&a).is_empty());
    }

    fn gid(index: u32, s: &str, kind: GidKind) -> GidEntry {
        let ip: std::net::Ipv6Addr = s.parse().unwrap();
        GidEntry {
            index,
            gid: ip.octets(),
            kind,
            netdev: Some("eth0".into()),
        }
    }

    #[test]
    fn gid_choice_prefers_ipv4_roce_v2() {
        let t = vec![
            gid(0, "fe80::1", GidKind::IbRoceV1),
            gid(1, "fe80::1", GidKind::RoceV2),
            gid(2, "::ffff:10.0.0.1", GidKind::IbRoceV1),
            gid(3, "::ffff:10.0.0.1", GidKind::RoceV2),
            gid(4, "2001:db8::1", GidKind::RoceV2),
        ];
        let (g, why) = choose_gid("mlx5_0", 1, true, &t, None).unwrap();
        assert_eq!((g.index, why), (3, GidChoice::Auto));
        assert_eq!(GidAddr(&g.gid).to_string(), "::ffff:10.0.0.1");
        assert_eq!(g.ipv4(), Some(Ipv4Addr::new(10, 0, 0, 1)));
        // without IPv4: global IPv6 v2, then link-local v2, then v1
        let (g, _) = choose_gid("d", 1, true, &t[..2], None).unwrap();
        assert_eq!(g.index, 1);
        let t2 = vec![t[0].clone(), t[1].clone(), t[4].clone()];
        assert_eq!(choose_gid("d", 1, true, &t2, None).unwrap().0.index, 4);
        assert_eq!(choose_gid("d", 1, true, &t[..1], None).unwrap().0.index, 0);
    }

    #[test]
    fn gid_choice_forced_and_errors() {
        let t = vec![
            gid(0, "fe80::1", GidKind::RoceV2),
            gid(1, "::ffff:192.0.2.1", GidKind::RoceV2),
        ];
        let (g, why) = choose_gid("rxe0", 1, true, &t, Some(0)).unwrap();
        assert_eq!((g.index, why), (0, GidChoice::Forced));
        let e = choose_gid("rxe0", 1, true, &t, Some(7)).unwrap_err();
        assert!(e.to_string().contains("valid: 0, 1"), "{e}");
        let e = choose_gid("rxe0", 1, true, &[], None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoDevice);
        assert!(e.to_string().contains("ip addr add"), "{e}");
        // InfiniBand: index 0 even when absent from a (partial) table
        let (g, why) = choose_gid("mlx5_0", 1, false, &[], None).unwrap();
        assert_eq!((g.index, why), (0, GidChoice::InfiniBand));
    }

    #[test]
    fn gid_kind_from_sysfs() {
        assert_eq!(GidKind::from_sysfs("RoCE v2\n"), GidKind::RoceV2);
        assert_eq!(GidKind::from_sysfs("IB/RoCE v1\n"), GidKind::IbRoceV1);
        assert_eq!(GidKind::from_sysfs(""), GidKind::Unknown);
        assert_eq!(
            GidAddr(&"fe80::1".parse::<std::net::Ipv6Addr>().unwrap().octets()).to_string(),
            "fe80::1"
        );
    }

    #[test]
    fn mtu_math() {
        assert_eq!(mtu_enum(4096), Some(5));
        assert_eq!(mtu_enum(9000), Some(5));
        assert_eq!(mtu_enum(1500), Some(3));
        assert_eq!(mtu_enum(255), None);
        assert_eq!(mtu_bytes(3), Some(1024));
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(6), None);
        assert_eq!(path_mtu(4096, 1024, 4096).unwrap(), 1024);
        assert_eq!(path_mtu(4096, 4096, 3000).unwrap(), 2048);
        assert_eq!(
            path_mtu(4096, 4096, 100).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn rails_wrap() {
        assert_eq!(rail_of(0, 2), 0);
        assert_eq!(rail_of(3, 2), 1);
        assert_eq!(rail_of(5, 1), 0);
        assert_eq!(rail_of(5, 0), 0);
    }
}
