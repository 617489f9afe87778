//! Parquet files read as the producer's inputs, from real files written by pyarrow with the
//! schema Hugging Face `datasets` gives an `Image` column (`struct<bytes: binary, path:
//! string>`, alone or in a list): each row a record with its images' bytes, or with the paths
//! it names; a file that is not Parquet, is cut short or lies in its footer is one reject; a
//! codec without a bound, a page over its limit and an image over its limit reject only what
//! they touch (`parquet_memory.rs` reads 10,000 rows and 300 damaged files in bounded memory).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::DATA;
use feedstore_producer::feed::{Indexed, RecordIndex};
use feedstore_producer::input::LocalFiles;
use feedstore_producer::manifest::Content;
use feedstore_producer::pipeline::Input;
use feedstore_producer::shards::Shard;
use feedstore_producer::source::ImageSource;
use feedstore_producer::tables::{ParquetFiles, ParquetRows, TableStats};
use feedstore_testkit::tar::{data_python, run_python_with};

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "feedstore-producer-{}-parquet-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn photo_path(name: &str) -> String {
    format!("{DATA}/photos/{name}")
}

fn photo(name: &str) -> Vec<u8> {
    std::fs::read(photo_path(name)).unwrap()
}

/// Writes `rows` to a Parquet file at `out` with pyarrow: `columns` are (name, kind), kind one
/// of `image` (a value is `[file or null, path or null]`), `images` (a list of those),
/// `turns` ({from, value}), `messages` ({role, content}), `qa` ({user, assistant, source}),
/// `binary` (a file, its bytes), `string`, `strings`, `int`.
fn write_parquet(
    out: &Path,
    columns: &[(&str, &str)],
    rows: serde_json::Value,
    options: serde_json::Value,
) {
    let script = r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
spec = json.load(sys.stdin)
image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
types = {
    "image": image,
    "images": pa.list_(image),
    "turns": pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())])),
    "messages": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    "qa": pa.list_(pa.struct([("user", pa.string()), ("assistant", pa.string()), ("source", pa.string())])),
    "string": pa.string(),
    "strings": pa.list_(pa.string()),
    "binary": pa.binary(),
    "int": pa.int64(),
}
def img(v):
    if v is None:
        return None
    f, p = v
    return {"bytes": open(f, "rb").read() if f else None, "path": p}
fields, arrays = [], []
for name, kind in spec["columns"]:
    values = [row.get(name) for row in spec["rows"]]
    if kind == "image":
        values = [img(v) for v in values]
    elif kind == "binary":
        values = [None if v is None else open(v, "rb").read() for v in values]
    elif kind == "images":
        values = [None if v is None else [img(x) for x in v] for v in values]
    fields.append(pa.field(name, types[kind]))
    arrays.append(pa.array(values, type=types[kind]))
table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
pq.write_table(table, spec["out"], **spec["options"])
"#;
    run_python_with(
        &data_python(),
        script,
        &serde_json::json!({"out": out, "columns": columns, "rows": rows, "options": options}),
    );
}

fn turns(q: &str, a: &str) -> serde_json::Value {
    serde_json::json!([{"from": "human", "value": format!("<image>\n{q}")}, {"from": "gpt", "value": a}])
}

/// Every input of `files`, read to the end: within a minute, or the test fails.
fn read_all(
    files: Vec<Shard>,
    reader: impl FnOnce(Vec<Shard>) -> ParquetFiles + Send + 'static,
) -> (Vec<Input>, Arc<TableStats>) {
    let (reader, all) = common::read_inputs(move || reader(files), Vec::new(), Vec::push);
    (all, reader.stats())
}

fn plain(
    root: PathBuf,
    max_image_bytes: u64,
) -> impl FnOnce(Vec<Shard>) -> ParquetFiles + Send + 'static {
    move |files| {
        ParquetFiles::new(
            files,
            Arc::new(LocalFiles::anywhere(max_image_bytes)),
            max_image_bytes,
            root,
        )
    }
}

/// (id, images' bytes or sources, content) of each row; (line, id, reason) of each reject.
#[derive(Debug)]
struct Row {
    id: String,
    bytes: Vec<Vec<u8>>,
    sources: Vec<ImageSource>,
    content: Content,
    origin: String,
}
type Rejected = (u64, Option<String>, String);

fn split(inputs: Vec<Input>) -> (Vec<Row>, Vec<Rejected>) {
    let (mut rows, mut rejects) = (Vec::new(), Vec::new());
    for input in inputs {
        match input {
            Input::Read(record, images) => {
                assert_eq!(record.images.len(), images.len());
                rows.push(Row {
                    id: record.id,
                    bytes: images.iter().map(|b| b.to_vec()).collect(),
                    sources: record.images,
                    content: record.content,
                    origin: record.origin.unwrap_or_default().into(),
                });
            }
            Input::Record(record) => rows.push(Row {
                id: record.id,
                bytes: Vec::new(),
                sources: record.images,
                content: record.content,
                origin: record.origin.unwrap_or_default().into(),
            }),
            Input::Rejected(r) => rejects.push((r.line, r.id, r.reason)),
        }
    }
    (rows, rejects)
}

fn messages(content: &Content) -> usize {
    match content {
        Content::Conversation(turns) => turns.len(),
        Content::Text(_) => 0,
    }
}

#[test]
fn rows_of_every_form_are_records_with_their_images() {
    let dir = scratch_dir("forms");
    // LLaVA's form: id, image, conversations; two row groups, zstd.
    let llava = dir.join("llava.parquet");
    write_parquet(
        &llava,
        &[
            ("id", "string"),
            ("image", "image"),
            ("conversations", "turns"),
            ("text", "string"),
        ],
        serde_json::json!([
            {"id": "hopper", "image": [photo_path("grace_hopper.jpg"), "grace_hopper.jpg"], "conversations": turns("who?", "an admiral")},
            {"id": "cat", "image": [photo_path("chelsea.png"), null], "conversations": turns("and this?", "a cat")},
            {"id": "words", "text": "plain text, trained on in full"},
        ]),
        serde_json::json!({"row_group_size": 2, "compression": "zstd"}),
    );
    // The Cauldron's: a list of images and its `texts` (questions and answers, the images
    // placed before the first), no id (the row names it); and the same images with chat
    // messages.
    let cauldron = dir.join("cauldron.parquet");
    write_parquet(
        &cauldron,
        &[
            ("images", "images"),
            ("texts", "qa"),
            ("messages", "messages"),
        ],
        serde_json::json!([{
            "images": [[photo_path("rocket.jpg"), "rocket.jpg"], [photo_path("chelsea.png"), "chelsea.png"]],
            "texts": [{"user": "which came first?", "assistant": "the cat"}, {"user": "sure?", "assistant": "yes"}],
        }, {
            "images": [[photo_path("rocket.jpg"), "rocket.jpg"], [photo_path("chelsea.png"), "chelsea.png"]],
            "messages": [{"role": "user", "content": "<image><image>which came first?"}, {"role": "assistant", "content": "the cat"}],
        }]),
        serde_json::json!({"compression": "snappy"}),
    );
    // Paths only (what `datasets` writes for images it was given as files): fetched as a
    // manifest's are, against the image root.
    let paths = dir.join("paths.parquet");
    write_parquet(
        &paths,
        &[
            ("id", "string"),
            ("image", "image"),
            ("conversations", "turns"),
        ],
        serde_json::json!([{"id": "by-path", "image": [null, "rocket.jpg"], "conversations": turns("what?", "a rocket")}]),
        serde_json::json!({"compression": "none"}),
    );
    // A captioning data set's: an image (here a plain binary column) and its caption.
    let captions = dir.join("captions.parquet");
    write_parquet(
        &captions,
        &[("image", "binary"), ("caption", "string")],
        serde_json::json!([{"image": photo_path("rocket.jpg"), "caption": "a rocket on its pad"}]),
        serde_json::json!({}),
    );
    let root = PathBuf::from(format!("{DATA}/photos"));
    let files = [&llava, &cauldron, &paths, &captions].map(|p| Shard::Local(p.to_path_buf()));
    let (inputs, stats) = read_all(files.to_vec(), plain(root.clone(), 64 << 20));
    let (rows, rejects) = split(inputs);
    assert!(rejects.is_empty(), "{rejects:?}");
    let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    // A row without an id is named by its file's whole name (data sets' subsets share file
    // names) and its row.
    let named = |file: &Path, row: u32| format!("{}:{row}", file.display());
    assert_eq!(
        ids,
        [
            "hopper",
            "cat",
            "words",
            &named(&cauldron, 0),
            &named(&cauldron, 1),
            "by-path",
            &named(&captions, 0)
        ]
    );
    assert_eq!(rows[0].bytes, [photo("grace_hopper.jpg")]);
    assert_eq!(rows[1].bytes, [photo("chelsea.png")]);
    assert_eq!(
        (rows[2].bytes.len(), &rows[2].content),
        (0, &Content::Text("plain text, trained on in full".into()))
    );
    assert_eq!(rows[3].bytes, [photo("rocket.jpg"), photo("chelsea.png")]);
    match &rows[3].content {
        Content::Conversation(turns) => {
            assert_eq!(turns.len(), 4);
            assert_eq!(turns[0].content, "<image>\n<image>\nwhich came first?");
            assert_eq!(turns[3].content, "yes");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rows[4].bytes, rows[3].bytes);
    assert_eq!(messages(&rows[4].content), 2);
    assert_eq!(rows[5].sources, [ImageSource::local(&root, "rocket.jpg")]);
    // The caption is the reply to the image.
    assert_eq!(rows[6].bytes, [photo("rocket.jpg")]);
    match &rows[6].content {
        Content::Conversation(turns) => {
            assert_eq!(turns.len(), 2);
            assert_eq!(turns[1].content, "a rocket on its pad");
        }
        other => panic!("{other:?}"),
    }
    // Where each row came from, for its rejects at any stage.
    assert_eq!(
        rows[1].origin,
        format!("{}: row 1 (row group 0)", llava.display())
    );
    assert_eq!(
        rows[2].origin,
        format!("{}: row 2 (row group 1)", llava.display())
    );
    assert!(matches!(&rows[0].sources[0], ImageSource::Member { name, .. } if name == "image"));
    assert!(matches!(&rows[3].sources[1], ImageSource::Member { name, .. } if name == "images[1]"));
    assert_eq!(stats.row_groups.load(Ordering::Relaxed), 5);
    assert_eq!(stats.unreadable.load(Ordering::Relaxed), 0);
    // A read of each file's end (its footer whole), and one per row group.
    assert_eq!(stats.requests.load(Ordering::Relaxed), 4 + 5);
}

#[test]
fn a_file_that_is_not_read_is_one_reject_naming_it() {
    let dir = scratch_dir("bad-files");
    let good = dir.join("good.parquet");
    write_parquet(
        &good,
        &[
            ("id", "string"),
            ("image", "image"),
            ("conversations", "turns"),
        ],
        serde_json::json!([{"id": "hopper", "image": [photo_path("grace_hopper.jpg"), null], "conversations": turns("who?", "an admiral")}]),
        serde_json::json!({}),
    );
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, data: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, data).unwrap();
        path
    };
    let mut lying = bytes.clone();
    let n = lying.len();
    lying[n - 8..n - 4].copy_from_slice(&(n as u32).to_le_bytes());
    let mut huge = bytes.clone();
    huge[n - 8..n - 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut garbled = bytes.clone();
    let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()) as usize;
    for b in &mut garbled[n - 8 - footer..n - 8] {
        *b = 0xff;
    }
    // A schema nested 40 deep (the reader builds it by recursion: refused before).
    let deep = dir.join("deep.parquet");
    run_python_with(
        &data_python(),
        r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
out = json.load(sys.stdin)
t = pa.int32()
for _ in range(40):
    t = pa.struct([("x", t)])
pq.write_table(pa.table({"deep": pa.array([None], type=t)}), out)
"#,
        &serde_json::json!(deep),
    );
    let fifo = dir.join("fifo.parquet");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let cases = [
        (
            write("jpeg.parquet", &photo("grace_hopper.jpg")),
            "not a Parquet file, or one cut short (it does not end in PAR1)",
        ),
        (write("empty.parquet", b""), "not a Parquet file (0 bytes)"),
        (
            write("cut.parquet", &bytes[..n - 100]),
            "does not end in PAR1",
        ),
        (write("lying.parquet", &lying), "more than the file's"),
        (write("huge.parquet", &huge), "over the 16777216-byte limit"),
        (
            write("garbled.parquet", &garbled),
            "its footer cannot be read",
        ),
        (fifo, "cannot open"),
        (dir.clone(), "cannot open"),
        (dir.join("missing.parquet"), "cannot open"),
    ];
    let mut files: Vec<Shard> = cases.iter().map(|(p, _)| Shard::Local(p.clone())).collect();
    files.push(Shard::Local(good.clone()));
    let (inputs, stats) = read_all(files, plain(dir.clone(), 64 << 20));
    let (rows, rejects) = split(inputs);
    // Each bad file is one reject; the good one after them is read.
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].bytes, [photo("grace_hopper.jpg")]);
    assert_eq!(rejects.len(), cases.len(), "{rejects:?}");
    for ((path, said), (line, id, reason)) in cases.iter().zip(&rejects) {
        assert!(id.is_none());
        assert!(
            reason.starts_with(&format!("{}: ", path.display())) && reason.contains(said),
            "{line}: {reason} (expected {said})"
        );
    }
    let lines: Vec<u64> = rejects.iter().map(|r| r.0).collect();
    assert_eq!(lines, (1..=cases.len() as u64).collect::<Vec<_>>());
    assert_eq!(stats.unreadable.load(Ordering::Relaxed), cases.len() as u64);
}

#[test]
fn what_a_limit_or_a_codec_refuses_loses_only_its_row_group() {
    let dir = scratch_dir("limits");
    let rows = serde_json::json!([
        {"id": "hopper", "image": [photo_path("grace_hopper.jpg"), null], "conversations": turns("who?", "an admiral")},
        {"id": "cat", "image": [photo_path("chelsea.png"), null], "conversations": turns("and this?", "a cat")},
        {"id": "rocket", "image": [photo_path("rocket.jpg"), null], "conversations": turns("what?", "a rocket")},
        {"id": "named", "image": [photo_path("rocket.jpg"), null], "conversations": turns("what?", "a rocket"), "images": ["nowhere.jpg"]},
    ]);
    let columns = [
        ("id", "string"),
        ("image", "image"),
        ("conversations", "turns"),
        ("images", "strings"),
    ];
    let one_per_group = dir.join("groups.parquet");
    write_parquet(
        &one_per_group,
        &columns,
        rows.clone(),
        serde_json::json!({"row_group_size": 1}),
    );
    let gzip = dir.join("gzip.parquet");
    write_parquet(
        &gzip,
        &columns,
        rows.clone(),
        serde_json::json!({"compression": "gzip"}),
    );

    // A page stating more than the limit (chelsea's 240 KB) loses its row group, not the file.
    let root = dir.clone();
    let (inputs, stats) = read_all(vec![Shard::Local(one_per_group.clone())], move |files| {
        plain(root, 64 << 20)(files).with_page_limit(200 << 10)
    });
    let (read, rejects) = split(inputs);
    let ids: Vec<&str> = read.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["hopper", "rocket"]);
    assert_eq!(rejects.len(), 2, "{rejects:?}");
    assert_eq!((rejects[1].0, rejects[1].1.as_deref()), (4, Some("named")));
    let (line, _, reason) = &rejects[0];
    assert_eq!(*line, 2);
    assert!(
        reason.starts_with(&format!(
            "{}: row group 1 (row 1): column image.bytes: the page at byte ",
            one_per_group.display()
        )) && reason.contains("bytes uncompressed, over the 204800-byte limit on a page"),
        "{reason}"
    );
    assert_eq!(stats.unreadable.load(Ordering::Relaxed), 1);

    // An encoding whose decoder allocates what its own header states: refused, saying so.
    let delta = dir.join("delta.parquet");
    write_parquet(
        &delta,
        &columns,
        rows.clone(),
        serde_json::json!({"use_dictionary": false, "column_encoding": {"id": "DELTA_BYTE_ARRAY"}}),
    );
    let (inputs, _) = read_all(
        vec![Shard::Local(delta.clone())],
        plain(PathBuf::from("/"), 64 << 20),
    );
    let (read, rejects) = split(inputs);
    assert!(read.is_empty());
    assert!(
        rejects.len() == 1
            && rejects[0].2.contains("column id: the page header at byte ")
            && rejects[0]
                .2
                .contains("encoding DELTA_BYTE_ARRAY, which feedstore does not read"),
        "{rejects:?}"
    );

    // gzip inflates to no stated bound: refused, saying what to write instead.
    let (inputs, _) = read_all(
        vec![Shard::Local(gzip.clone())],
        plain(PathBuf::from("/"), 64 << 20),
    );
    let (read, rejects) = split(inputs);
    assert!(read.is_empty());
    assert_eq!(rejects.len(), 1, "{rejects:?}");
    assert!(
        rejects[0]
            .2
            .contains("row group 0 (rows 0 to 3): column id is compressed with gzip")
            && rejects[0].2.contains("snappy or zstd"),
        "{rejects:?}"
    );

    // An image over --max-image-bytes, and a record naming an image its row does not hold,
    // reject their rows alone.
    let (inputs, _) = read_all(
        vec![Shard::Local(one_per_group.clone())],
        plain(PathBuf::from("/"), 200 << 10),
    );
    let (read, rejects) = split(inputs);
    let ids: Vec<&str> = read.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["hopper", "rocket"]);
    assert_eq!(rejects.len(), 2, "{rejects:?}");
    assert_eq!(rejects[0].1.as_deref(), Some("cat"));
    assert!(
        rejects[0]
            .2
            .contains("row 1 (row group 1): column image: an image of 240512 bytes"),
        "{rejects:?}"
    );
    assert!(
        rejects[0]
            .2
            .contains("over the 204800-byte limit (--max-image-bytes)"),
        "{rejects:?}"
    );
    assert!(
        rejects[1].2.contains(
            "the record names image \"nowhere.jpg\", not one of the images its row holds (image)"
        ),
        "{rejects:?}"
    );
}

/// A row read by index, as [`split`] makes it.
fn indexed_row(read: Indexed) -> Row {
    let (record, images) = (read.record, read.images.unwrap_or_default());
    assert_eq!(record.images.len(), images.len());
    Row {
        id: record.id,
        bytes: images.iter().map(|b| b.to_vec()).collect(),
        sources: record.images,
        content: record.content,
        origin: record.origin.unwrap_or_default().into(),
    }
}

/// `ParquetRows`, a stream's source: rows read by index, in any order and from any number of
/// threads, are the rows a one-pass read gives (records, image bytes, origins; `line` the
/// index + 1), over files of several row groups, one with no rows between them. Each row
/// group is read once while the cache holds it, and again (counted) once the cache let it go;
/// a row group that fails a check rejects its rows only, counted once; a file written again
/// with other row groups after the stream started is refused rather than read as other
/// records.
#[test]
fn rows_by_index_are_the_rows_a_one_pass_read_gives() {
    let dir = scratch_dir("index");
    let photos = ["grace_hopper.jpg", "chelsea.png", "rocket.jpg"];
    let made = |n: usize, tag: &str| {
        serde_json::Value::Array(
            (0..n)
                .map(|i| match i % 4 {
                    3 => {
                        serde_json::json!({"id": format!("{tag}{i}"), "text": format!("text {i}")})
                    }
                    _ => serde_json::json!({
                        "id": format!("{tag}{i}"),
                        "image": [photo_path(photos[i % 3]), null],
                        "conversations": turns(&format!("question {i}?"), "an answer"),
                    }),
                })
                .collect(),
        )
    };
    let columns = [
        ("id", "string"),
        ("image", "image"),
        ("conversations", "turns"),
        ("text", "string"),
    ];
    let (a, empty, b) = (
        dir.join("a.parquet"),
        dir.join("empty.parquet"),
        dir.join("b.parquet"),
    );
    let groups_of = |n: usize| serde_json::json!({"row_group_size": n});
    write_parquet(&a, &columns, made(10, "a"), groups_of(4));
    write_parquet(&empty, &columns, made(0, "e"), groups_of(4));
    write_parquet(&b, &columns, made(5, "b"), groups_of(5));
    let files: Vec<Shard> = [&a, &empty, &b]
        .iter()
        .map(|p| Shard::Local(p.to_path_buf()))
        .collect();
    let (inputs, _) = read_all(files.clone(), plain(dir.clone(), 64 << 20));
    let (expected, rejects) = split(inputs);
    assert!(rejects.is_empty(), "{rejects:?}");
    assert_eq!(expected.len(), 15);

    let open = |cache_bytes: u64| {
        ParquetRows::open(
            files.clone(),
            Arc::new(LocalFiles::anywhere(64 << 20)),
            64 << 20,
            dir.clone(),
            cache_bytes,
        )
        .unwrap()
    };
    let same = |rows: &ParquetRows, index: u64| {
        let read = rows.get(index).unwrap();
        assert_eq!(read.record.line, index + 1);
        let (row, want) = (indexed_row(read), &expected[index as usize]);
        assert_eq!(
            (&row.id, &row.bytes, &row.sources, &row.content, &row.origin),
            (
                &want.id,
                &want.bytes,
                &want.sources,
                &want.content,
                &want.origin
            ),
        );
    };

    // Out of order, with room for every row group: each is read once.
    let rows = open(1 << 30);
    assert_eq!((rows.len(), rows.largest_piece()), (15, 5));
    for i in 0..15 {
        same(&rows, (i * 7) % 15);
    }
    let reads = rows.stats();
    assert_eq!(reads.row_groups.load(Ordering::Relaxed), 4);
    assert_eq!(rows.reads().reread.load(Ordering::Relaxed), 0);
    let past = rows.get(15).unwrap_err();
    assert!(
        past.reason.contains("record 15 is past the 15 records"),
        "{past:?}"
    );

    // Reads ahead, then four threads at once, each its own order: still one read per row
    // group.
    let rows = Arc::new(open(1 << 30));
    for i in [0, 14, 13] {
        rows.clone().prefetch(i);
    }
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let rows = rows.clone();
            scope.spawn(move || {
                for i in 0..15 {
                    same(&rows, (i * (t * 2 + 1) + t) % 15);
                }
            });
        }
    });
    assert_eq!(rows.stats().row_groups.load(Ordering::Relaxed), 4);

    // A cache of one row group, read back and forth between files: read again, still the same
    // rows.
    let rows = open(1);
    for i in 0..15u64 {
        same(&rows, if i % 2 == 0 { i / 2 } else { 14 - i / 2 });
    }
    assert!(rows.reads().reread.load(Ordering::Relaxed) > 0);

    // A page over the limit (chelsea's, in rows 1 and 4 of a and row 1 of b) loses its row
    // groups' rows, each a reject naming the row group; the group is counted once.
    let rows = open(1 << 30).with_page_limit(200 << 10);
    for i in 0..15u64 {
        match rows.get(i) {
            Ok(_) => assert!(i == 8 || i == 9, "row {i} read"),
            Err(reject) => {
                assert_eq!(reject.line, i + 1);
                let group = match i {
                    0..4 => format!("{}: row group 0 (rows 0 to 3): ", a.display()),
                    4..8 => format!("{}: row group 1 (rows 4 to 7): ", a.display()),
                    _ => format!("{}: row group 0 (rows 0 to 4): ", b.display()),
                };
                assert!(
                    reject.reason.starts_with(&group)
                        && reject
                            .reason
                            .contains("over the 204800-byte limit on a page"),
                    "{reject:?}"
                );
            }
        }
    }
    assert_eq!(rows.stats().unreadable.load(Ordering::Relaxed), 3);

    // b written again once the stream started: before it was opened, with the same row
    // groups or others; or in place (as pyarrow writes) while it is held open, with the same
    // row groups. Its rows are refused, a's still read.
    for (groups, opened_first) in [(5, false), (2, false), (5, true)] {
        let reader = open(1);
        if opened_first {
            same(&reader, 10);
            // (The cache keeps one row group: b's goes.)
            same(&reader, 3);
        }
        write_parquet(&b, &columns, rows_of_five_again(), groups_of(groups));
        let changed = reader.get(11).unwrap_err();
        assert!(
            changed
                .reason
                .contains("it changed since the stream started"),
            "{changed:?}"
        );
        same(&reader, 3);
        write_parquet(&b, &columns, made(5, "b"), groups_of(5));
    }
}

fn rows_of_five_again() -> serde_json::Value {
    serde_json::Value::Array(
        (0..5)
            .map(|i| serde_json::json!({"id": format!("again{i}"), "text": "rewritten"}))
            .collect(),
    )
}
