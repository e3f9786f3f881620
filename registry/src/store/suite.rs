//! The shared test suite every `ObjectStore` backend must pass.

use bytes::Bytes;
use futures_util::{stream, TryStreamExt};

use super::{ByteStream, ObjectKey, ObjectStore, Segment, StoreError};
use amber_oci::digest::{Algorithm, Digest};

fn body(parts: &[&'static [u8]]) -> ByteStream {
    let v: Vec<std::io::Result<Bytes>> = parts.iter().map(|p| Ok(Bytes::from_static(p))).collect();
    Box::pin(stream::iter(v))
}

async fn collect(s: ByteStream) -> Vec<u8> {
    s.try_fold(Vec::new(), |mut acc, b| async move {
        acc.extend_from_slice(&b);
        Ok(acc)
    })
    .await
    .unwrap()
}

pub async fn run(store: &dyn ObjectStore) {
    put_is_create_once(store).await;
    put_replacing_replaces_whole(store).await;
    remove_is_of_one_object_and_idempotent(store).await;
    ranges(store).await;
    ranges_of_a_large_object(store).await;
    staged_lifecycle(store).await;
    staged_offset_is_checked(store).await;
    orphan_removal_keeps_published_bytes(store).await;
    discarded_segments_leave_the_acknowledged_bytes(store).await;
    declared_lengths_are_held(store).await;
    concurrent_publish_of_same_content(store).await;
    records_are_compare_and_swap(store).await;
    records_list_in_pages(store).await;
    levels_list_one_level_and_walk_the_tree(store).await;
}

async fn records_list_in_pages(store: &dyn ObjectStore) {
    use super::RecordKey;
    let prefix = RecordKey::CATALOG;
    let names = ["pages/a", "pages/b", "pages/b/c", "pages/d", "pages/e"];
    for n in names {
        let repo = amber_oci::names::RepoName::parse(n).unwrap();
        store
            .put_record(&RecordKey::repo(&repo), Bytes::new(), None)
            .await
            .unwrap()
            .expect("created");
    }
    let page = |after: Option<&'static str>, limit| async move {
        store
            .list_records_page(prefix, after, limit)
            .await
            .unwrap()
            .iter()
            .map(|k| k.catalog_repo().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    // In byte order ("pages/b" < "pages/b/c" < "pages/d"), after the named one.
    assert_eq!(page(None, 2).await, ["pages/a", "pages/b"]);
    assert_eq!(page(Some("pages/b"), 2).await, ["pages/b/c", "pages/d"]);
    assert_eq!(page(Some("pages/d"), 10).await, ["pages/e"]);
    assert!(page(Some("pages/e"), 10).await.is_empty());
    // A name that is not there starts the page after where it would be.
    assert_eq!(page(Some("pages/c"), 1).await, ["pages/d"]);
}

async fn records_are_compare_and_swap(store: &dyn ObjectStore) {
    use super::RecordKey;
    let repo = amber_oci::names::RepoName::parse("suite/app").unwrap();
    let tag = amber_oci::names::Tag::parse("latest").unwrap();
    let key = RecordKey::tag(&repo, &tag);
    assert!(store.get_record(&key).await.unwrap().is_none());
    let v1 = store
        .put_record(&key, Bytes::from_static(b"one"), None)
        .await
        .unwrap()
        .expect("created");
    // Create-only fails once it exists.
    assert!(store
        .put_record(&key, Bytes::from_static(b"two"), None)
        .await
        .unwrap()
        .is_none());
    let v2 = store
        .put_record(&key, Bytes::from_static(b"two"), Some(&v1))
        .await
        .unwrap()
        .expect("swapped");
    // A stale version loses.
    assert!(store
        .put_record(&key, Bytes::from_static(b"three"), Some(&v1))
        .await
        .unwrap()
        .is_none());
    let (value, v) = store.get_record(&key).await.unwrap().unwrap();
    assert_eq!((&value[..], &v), (&b"two"[..], &v2));
    let d = Digest::of(Algorithm::Sha256, b"m");
    store
        .put_record(
            &RecordKey::manifest(&repo, &d),
            Bytes::from_static(b"{}"),
            None,
        )
        .await
        .unwrap()
        .unwrap();
    let listed = store
        .list_records("_records/repos/suite/app/")
        .await
        .unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.contains(&key));
    // Records are not published objects.
    assert!(store.list("_records/").await.unwrap().is_empty());

    // A work record can be removed, and then created again; removing twice is fine.
    // Replacing a removed one at the version it had fails as a stale version does (a
    // request that lands after its upload finished).
    let work = RecordKey::upload(&uuid::Uuid::new_v4());
    let had = store
        .put_record(&work, Bytes::from_static(b"session"), None)
        .await
        .unwrap()
        .expect("created");
    assert_eq!(
        store.list_records(RecordKey::UPLOADS).await.unwrap(),
        vec![work.clone()]
    );
    store.delete_record(&work).await.unwrap();
    store.delete_record(&work).await.unwrap();
    assert!(store.get_record(&work).await.unwrap().is_none());
    assert!(store
        .put_record(&work, Bytes::from_static(b"late"), Some(&had))
        .await
        .unwrap()
        .is_none());
    assert!(store.get_record(&work).await.unwrap().is_none());
    assert!(store
        .list_records(RecordKey::UPLOADS)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .put_record(&work, Bytes::from_static(b"again"), None)
        .await
        .unwrap()
        .is_some());
    store.delete_record(&work).await.unwrap();
}

async fn put_is_create_once(store: &dyn ObjectStore) {
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"manifest"));
    assert_eq!(store.stat(&key).await.unwrap(), None);
    assert!(matches!(
        store.read_all(&key).await,
        Err(StoreError::NotFound(_))
    ));
    store
        .put(&key, Bytes::from_static(b"manifest"))
        .await
        .unwrap();
    store
        .put(&key, Bytes::from_static(b"manifest"))
        .await
        .unwrap();
    assert_eq!(store.stat(&key).await.unwrap(), Some(8));
    assert_eq!(&store.read_all(&key).await.unwrap()[..], b"manifest");
    let listed = store.list("blobs/sha256/").await.unwrap();
    assert!(listed.contains(&key));
    // Objects stored as themselves list with their sizes, without a request each.
    let chunk = ObjectKey::chunk(&amber_oci::env::ChunkId::of(b"a chunk"));
    store
        .put(&chunk, Bytes::from_static(b"chunk bytes"))
        .await
        .unwrap();
    let sized = store.list_sizes("chunks/").await.unwrap();
    assert!(sized.contains(&(chunk, 11)), "{sized:?}");
}

/// A replacing put (a chunk recompressed): the new bytes whole, for stat, read, listing
/// and a ranged read; creates the object when it is missing.
async fn put_replacing_replaces_whole(store: &dyn ObjectStore) {
    let chunk = ObjectKey::chunk(&amber_oci::env::ChunkId::of(b"recompressed"));
    store
        .put_replacing(&chunk, Bytes::from_static(b"first encoding, longer"))
        .await
        .unwrap();
    assert_eq!(store.stat(&chunk).await.unwrap(), Some(22));
    store
        .put_replacing(&chunk, Bytes::from_static(b"second"))
        .await
        .unwrap();
    assert_eq!(store.stat(&chunk).await.unwrap(), Some(6));
    assert_eq!(&store.read_all(&chunk).await.unwrap()[..], b"second");
    assert_eq!(
        collect(store.read(&chunk, 1..4).await.unwrap()).await,
        b"eco"
    );
    let sized = store.list_sizes("chunks/").await.unwrap();
    assert!(sized.contains(&(chunk.clone(), 6)), "{sized:?}");
    // A plain put of an existing key still leaves it as it is.
    store
        .put(&chunk, Bytes::from_static(b"other"))
        .await
        .unwrap();
    assert_eq!(&store.read_all(&chunk).await.unwrap()[..], b"second");
}

/// Removal (a layer blob replaced by its recipe): the object is gone for stat, read and
/// listing, its neighbours stay, a second removal is not an error, and a later publish
/// of the same content makes it readable again.
async fn remove_is_of_one_object_and_idempotent(store: &dyn ObjectStore) {
    let gone = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"layer to remove"));
    let kept = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"layer to keep"));
    store
        .put(&gone, Bytes::from_static(b"layer to remove"))
        .await
        .unwrap();
    store
        .put(&kept, Bytes::from_static(b"layer to keep"))
        .await
        .unwrap();
    store.remove(&gone).await.unwrap();
    store.remove(&gone).await.unwrap();
    assert_eq!(store.stat(&gone).await.unwrap(), None);
    assert!(matches!(
        store.read(&gone, 0..5).await.map(|_| ()),
        Err(StoreError::NotFound(_))
    ));
    let listed = store.list("blobs/sha256/").await.unwrap();
    assert!(!listed.contains(&gone) && listed.contains(&kept));
    assert_eq!(&store.read_all(&kept).await.unwrap()[..], b"layer to keep");
    store
        .put(&gone, Bytes::from_static(b"layer to remove"))
        .await
        .unwrap();
    assert_eq!(store.stat(&gone).await.unwrap(), Some(15));
}

async fn ranges(store: &dyn ObjectStore) {
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"0123456789"));
    store
        .put(&key, Bytes::from_static(b"0123456789"))
        .await
        .unwrap();
    assert_eq!(
        collect(store.read(&key, 0..10).await.unwrap()).await,
        b"0123456789"
    );
    assert_eq!(
        collect(store.read(&key, 3..7).await.unwrap()).await,
        b"3456"
    );
    assert_eq!(collect(store.read(&key, 10..10).await.unwrap()).await, b"");
    assert!(matches!(
        store.read(&key, 5..11).await,
        Err(StoreError::BadRange { .. })
    ));
}

/// Reads that start, end and cross the pieces a backend streams in (the fs backend maps
/// 512 KiB windows; S3 ranges are cut by the server), at offsets that are not page aligned.
async fn ranges_of_a_large_object(store: &dyn ObjectStore) {
    let data: Vec<u8> = (0..3 * (1u32 << 20) + 4099)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let len = data.len() as u64;
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, &data));
    store.put(&key, Bytes::from(data.clone())).await.unwrap();
    let window = 512 << 10;
    for range in [
        0..len,
        1..len,
        4097..window + 5,
        window - 1..window + 1,
        window..2 * window,
        len - 1..len,
        2 * window + 3..len - 2,
    ] {
        let got = collect(store.read(&key, range.clone()).await.unwrap()).await;
        assert!(
            got == data[range.start as usize..range.end as usize],
            "range {range:?} of a {len}-byte object"
        );
    }
}

/// Appends `parts` to staged object `id` at `offset`; the segment written.
async fn append(
    store: &dyn ObjectStore,
    id: &str,
    offset: u64,
    parts: &[&'static [u8]],
) -> Segment {
    let appended = store
        .append_staged(id, offset, body(parts), None, &mut |_| {})
        .await
        .unwrap();
    let n: usize = parts.iter().map(|p| p.len()).sum();
    assert_eq!(appended.len, offset + n as u64);
    appended
        .segment
        .expect("a non-empty append writes a segment")
}

async fn staged_lifecycle(store: &dyn ObjectStore) {
    let id = "0000aaaa-0000-0000-0000-000000000001";
    let mut seen = 0usize;
    let first = store
        .append_staged(id, 0, body(&[b"hello ", b"wor"]), None, &mut |c| {
            seen += c.len()
        })
        .await
        .unwrap();
    assert_eq!((first.len, seen), (9, 9));
    let first = first.segment.unwrap();
    assert_eq!(first.start, 0);
    let second = append(store, id, 9, &[b"ld!"]).await;
    assert_eq!(second.start, 9);
    let acked = [first, second];
    assert_eq!(store.staged_len(id).await.unwrap(), Some(12));
    assert_eq!(
        collect(store.read_staged(id, &acked, 12).await.unwrap()).await,
        b"hello world!"
    );
    assert!(store.list_staged().await.unwrap().contains(&id.to_string()));
    // An empty append (the closing PUT of a chunked upload) writes no segment.
    let empty = store
        .append_staged(id, 12, body(&[]), None, &mut |_| {})
        .await
        .unwrap();
    assert_eq!((empty.len, empty.segment), (12, None));
    // Bytes past the acknowledged length (a request that never finished) are neither
    // read nor published.
    append(store, id, 12, &[b" and more"]).await;
    assert_eq!(
        collect(store.read_staged(id, &acked, 12).await.unwrap()).await,
        b"hello world!"
    );
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"hello world!"));
    store.publish_staged(id, &acked, 12, &key).await.unwrap();
    assert_eq!(&store.read_all(&key).await.unwrap()[..], b"hello world!");
    // What the unacknowledged request left goes with the session's staged data.
    store.remove_staged(id, &[]).await.unwrap();
    assert_eq!(store.staged_len(id).await.unwrap(), None);
    assert_eq!(&store.read_all(&key).await.unwrap()[..], b"hello world!");
    // Bad ids never reach the backend's namespace.
    assert!(store.staged_len("../../etc/passwd").await.is_err());
}

/// A blob published from one segment, with an unacknowledged request's segment left
/// under its session: removing the orphaned staged data (recovery, fsck) keeps the blob
/// whole, wherever the backend published it from.
async fn orphan_removal_keeps_published_bytes(store: &dyn ObjectStore) {
    let id = "0000aaaa-0000-0000-0000-000000000003";
    let data: &'static [u8] = b"published from one segment";
    let acked = [append(store, id, 0, &[data]).await];
    append(store, id, data.len() as u64, &[b"never acknowledged"]).await;
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, data));
    store
        .publish_staged(id, &acked, data.len() as u64, &key)
        .await
        .unwrap();
    store.remove_staged(id, &[]).await.unwrap();
    assert!(!store.list_staged().await.unwrap().contains(&id.to_string()));
    assert_eq!(&store.read_all(&key).await.unwrap()[..], data);
    assert_eq!(store.stat(&key).await.unwrap(), Some(data.len() as u64));
}

async fn staged_offset_is_checked(store: &dyn ObjectStore) {
    let id = "0000aaaa-0000-0000-0000-000000000002";
    let abc = append(store, id, 0, &[b"abc"]).await;
    // A request that never finished appended at 3; the next append there is the one
    // acknowledged.
    append(store, id, 3, &[b"def"]).await;
    let x = append(store, id, 3, &[b"x"]).await;
    let acked = [abc, x];
    assert_eq!(
        collect(store.read_staged(id, &acked, 4).await.unwrap()).await,
        b"abcx"
    );
    // A length the segments do not hold is refused when read or published; nothing is
    // published.
    let short = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"abcx??"));
    let refused = |e: &StoreError| {
        matches!(
            e,
            StoreError::OffsetMismatch { .. } | StoreError::BadRange { .. }
        )
    };
    let err = match store.read_staged(id, &acked, 6).await {
        Ok(s) => s.try_collect::<Vec<_>>().await.err().map(StoreError::Body),
        Err(e) => Some(e),
    };
    assert!(
        err.as_ref()
            .is_some_and(|e| refused(e) || matches!(e, StoreError::Body(_))),
        "{err:?}"
    );
    let err = store
        .publish_staged(id, &acked, 6, &short)
        .await
        .unwrap_err();
    assert!(refused(&err), "{err}");
    assert_eq!(store.stat(&short).await.unwrap(), None);
    // Appending to a session that does not exist (offset > 0) is refused at the append
    // (fs) or when published (s3: no segment from byte 0); nothing is published.
    let dead = "0000aaaa-0000-0000-0000-00000000dead";
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"?????x"));
    let err = match store
        .append_staged(dead, 5, body(&[b"x"]), None, &mut |_| {})
        .await
    {
        Err(e) => e,
        Ok(a) => store
            .publish_staged(dead, &[a.segment.unwrap()], 6, &key)
            .await
            .unwrap_err(),
    };
    assert!(
        matches!(
            err,
            StoreError::NotFound(_) | StoreError::OffsetMismatch { .. }
        ),
        "{err}"
    );
    assert_eq!(store.stat(&key).await.unwrap(), None);
    store.remove_staged(dead, &[]).await.unwrap();
    store.remove_staged(id, &acked).await.unwrap();
    assert_eq!(store.staged_len(id).await.unwrap(), None);
    assert_eq!(store.staged_len(dead).await.unwrap(), None);
}

/// A segment written but never acknowledged (its request lost the compare-and-swap) is
/// dropped, and what was acknowledged before it stays.
async fn discarded_segments_leave_the_acknowledged_bytes(store: &dyn ObjectStore) {
    let id = "0000aaaa-0000-0000-0000-000000000004";
    let acked = [append(store, id, 0, &[b"kept"]).await];
    let lost = append(store, id, 4, &[b" lost"]).await;
    store.discard_segment(id, &lost).await.unwrap();
    store.discard_segment(id, &lost).await.unwrap();
    assert_eq!(store.staged_len(id).await.unwrap(), Some(4));
    assert_eq!(
        collect(store.read_staged(id, &acked, 4).await.unwrap()).await,
        b"kept"
    );
    store.remove_staged(id, &acked).await.unwrap();
    assert_eq!(store.staged_len(id).await.unwrap(), None);
}

/// A body declared to be `len` bytes (a Content-Length) is appended only when it is
/// exactly that long, small (one write) or larger than an S3 part (one streamed PUT).
async fn declared_lengths_are_held(store: &dyn ObjectStore) {
    let big: Bytes = (0..(9u32 << 20) + 77).map(|i| (i % 251) as u8).collect();
    let one = |b: Bytes| -> ByteStream { Box::pin(stream::iter([Ok(b)])) };
    let halves = |b: &Bytes| -> ByteStream {
        let (x, y) = (b.slice(..b.len() / 2), b.slice(b.len() / 2..));
        Box::pin(stream::iter([Ok(x), Ok(y)]))
    };
    for (i, data) in [Bytes::from_static(b"declared"), big]
        .into_iter()
        .enumerate()
    {
        let n = data.len() as u64;
        let id = format!("0000cccc-0000-0000-0000-{i:012}");
        // Shorter than declared: the body's error, and nothing acknowledged is changed.
        let short = data.slice(..data.len() - 1);
        let err = store
            .append_staged(&id, 0, one(short), Some(n), &mut |_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::Body(_)),
            "short body of {n}: {err}"
        );
        // Longer than declared: the same.
        let err = store
            .append_staged(&id, 0, halves(&data), Some(n - 1), &mut |_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::Body(_)),
            "long body of {n}: {err}"
        );
        // Exactly as declared, in two chunks: staged and published whole.
        let mut seen = 0u64;
        let got = store
            .append_staged(&id, 0, halves(&data), Some(n), &mut |c| {
                seen += c.len() as u64
            })
            .await
            .unwrap();
        assert_eq!((got.len, seen), (n, n));
        let acked = [got.segment.unwrap()];
        assert_eq!(
            collect(store.read_staged(&id, &acked, n).await.unwrap()).await,
            data
        );
        let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, &data));
        store.publish_staged(&id, &acked, n, &key).await.unwrap();
        assert_eq!(store.stat(&key).await.unwrap(), Some(n));
        assert_eq!(store.read_all(&key).await.unwrap(), data);
    }
}

async fn concurrent_publish_of_same_content(store: &dyn ObjectStore) {
    let data: &'static [u8] = b"same content from sixteen uploads";
    let key = ObjectKey::blob(&Digest::of(Algorithm::Sha256, data));
    let mut staged = Vec::new();
    for i in 0..16 {
        let id = format!("0000bbbb-0000-0000-0000-{i:012}");
        let segment = append(store, &id, 0, &[data]).await;
        staged.push((id, [segment]));
    }
    let publishes = staged
        .iter()
        .map(|(id, acked)| store.publish_staged(id, acked, data.len() as u64, &key));
    for r in futures_util::future::join_all(publishes).await {
        r.unwrap();
    }
    assert_eq!(&store.read_all(&key).await.unwrap()[..], data);
    let left = store.list_staged().await.unwrap();
    assert!(staged.iter().all(|(id, _)| !left.contains(id)));
}

/// `list_level` gives the keys (with sizes) and the prefixes directly under a prefix;
/// `walk` finds every key under a root, skipping the prefixes it is told to; prefixes of
/// staged objects, or not ending in `/`, list nothing.
async fn levels_list_one_level_and_walk_the_tree(store: &dyn ObjectStore) {
    use super::{Level, RecordKey};
    for (k, v) in [
        ("_records/lvl/a", "1"),
        ("_records/lvl/b/c", "22"),
        ("_records/lvl/b/d/e", "333"),
        ("_records/lvl/f", "4444"),
    ] {
        let key = RecordKey::parse(k).unwrap();
        store
            .put_record(&key, Bytes::from_static(v.as_bytes()), None)
            .await
            .unwrap()
            .expect("created");
    }
    let level = |p: &'static str| async move { store.list_level(p).await.unwrap() };
    let owned = |keys: &[(&str, u64)]| keys.iter().map(|(k, n)| (k.to_string(), *n)).collect();
    assert_eq!(
        level("_records/lvl/").await,
        Level {
            keys: owned(&[("_records/lvl/a", 1), ("_records/lvl/f", 4)]),
            prefixes: vec!["_records/lvl/b/".to_string()],
        }
    );
    assert_eq!(
        level("_records/lvl/b/").await,
        Level {
            keys: owned(&[("_records/lvl/b/c", 2)]),
            prefixes: vec!["_records/lvl/b/d/".to_string()],
        }
    );
    for nothing in [
        "_records/none/",
        "_records/lvl",
        "_staging/",
        "_records/../",
        "_records//",
    ] {
        assert_eq!(level(nothing).await, Level::default(), "{nothing}");
    }
    let chunk = ObjectKey::chunk(&amber_oci::env::ChunkId::of(b"a chunk in a level"));
    store
        .put(&chunk, Bytes::from_static(b"leveled"))
        .await
        .unwrap();

    let walked = |root: &'static str, skip: &'static str| async move {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let walk = super::walk(store, root, |p| p != skip, 3, tx);
        let read = async {
            let mut all = Vec::new();
            while let Some(batch) = rx.recv().await {
                all.extend(batch);
            }
            all
        };
        let (walked, mut all) = futures_util::join!(walk, read);
        walked.unwrap();
        all.sort();
        all
    };
    assert_eq!(
        walked("_records/lvl/", "_records/lvl/b/d/").await,
        owned(&[
            ("_records/lvl/a", 1),
            ("_records/lvl/b/c", 2),
            ("_records/lvl/f", 4)
        ])
    );
    assert!(walked("chunks/", "")
        .await
        .contains(&(chunk.as_str().to_string(), 7)));
}
