#!/usr/bin/env bash
# Checks `braid report --html` in a real (headless) browser.
#
# Makes a small traced run at 2 and 1 ranks and bus-bandwidth files for
# the shm and tcp backends, writes the HTML report, renders it in headless
# Chromium (a screenshot and the rendered DOM) and checks that the page's
# four plots (<svg data-plot="scaling|busbw|steps|timeline">) are there
# and drawn, and that the page fetches nothing from the network.
#
#   scripts/report-html/check.sh            # from the repository root
#   BRAID=target/release/braid OUTDIR=/tmp/r scripts/report-html/check.sh
#
# BRAID: the braid binary (default ./target/debug/braid, built with cargo
#   if missing). OUTDIR: where report.html, report.png and README.md go
#   (default bench/results/<date>-report-html). SHOT_HEIGHT: the
#   screenshot's height in pixels (default 4200). CHROMIUM: the browser
#   (default: chromium, chromium-browser or google-chrome on PATH; Debian's
#   chromium is installed with apt-get if none is and we are root).
# Exits 0 when every check passes, 1 with a message naming what failed.
set -euo pipefail

cd "$(dirname "$0")/../.."
fail() {
    echo "check.sh: FAIL: $*" >&2
    exit 1
}
step() { echo "== $*"; }

# 1. The binary.
if [[ -z "${BRAID:-}" ]]; then
    BRAID=./target/debug/braid
    if [[ ! -x "$BRAID" ]]; then
        step "building braid (cargo build -p braid)"
        cargo build -p braid
        BRAID="${CARGO_TARGET_DIR:-target}/debug/braid"
    fi
fi
[[ -x "$BRAID" ]] || fail "no braid binary at $BRAID (set BRAID=path/to/braid)"
BRAID="$(realpath "$BRAID")"

OUTDIR="${OUTDIR:-bench/results/$(date +%Y-%m-%d)-report-html}"
mkdir -p "$OUTDIR"
OUTDIR="$(realpath "$OUTDIR")"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# 2. A small traced run at two world sizes, and bench files per backend.
step "traced runs and benches in $TMP"
(cd "$TMP" && "$BRAID" train --nproc 2 --steps 8 --trace "$TMP/tr2") >"$TMP/train2.log" 2>&1 ||
    fail "braid train --nproc 2 failed: $(tail -5 "$TMP/train2.log")"
(cd "$TMP" && "$BRAID" train --nproc 1 --steps 8 --trace "$TMP/tr1") >"$TMP/train1.log" 2>&1 ||
    fail "braid train --nproc 1 failed: $(tail -5 "$TMP/train1.log")"
for backend in shm tcp; do
    "$BRAID" bench all_reduce --np 2 -b 1K -e 4M --backend "$backend" \
        --json "$TMP/$backend.json" >"$TMP/bench-$backend.log" 2>&1 ||
        fail "braid bench --backend $backend failed: $(tail -5 "$TMP/bench-$backend.log")"
done

# 3. The report.
step "braid report --html $OUTDIR/report.html"
REPORT_CMD=(report "$TMP/tr2" --compare "$TMP/tr1" --bench "$TMP/shm.json"
    --bench "$TMP/tcp.json" --html "$OUTDIR/report.html")
"$BRAID" "${REPORT_CMD[@]}" >"$TMP/report.txt" 2>&1 ||
    fail "braid report failed: $(tail -5 "$TMP/report.txt")"
[[ -s "$OUTDIR/report.html" ]] || fail "braid report wrote no $OUTDIR/report.html"

# 4. Headless Chromium.
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}"
INSTALLED="already installed"
if [[ -z "$CHROMIUM" ]]; then
    [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null ||
        fail "no chromium on PATH (install Debian's chromium, or set CHROMIUM=...)"
    step "installing chromium (apt-get)"
    t0=$(date +%s)
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >"$TMP/apt.log" 2>&1 ||
        fail "apt-get install chromium failed: $(tail -5 "$TMP/apt.log")"
    INSTALLED="installed by this script (apt-get install chromium: $(($(date +%s) - t0)) s)"
    echo "   chromium $INSTALLED"
    CHROMIUM="$(command -v chromium)"
fi
VERSION="$("$CHROMIUM" --version 2>/dev/null | head -1)"
step "rendering with $VERSION"
FLAGS=(--headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run
    --allow-file-access-from-files)
URL="file://$OUTDIR/report.html"
timeout 120 "$CHROMIUM" "${FLAGS[@]}" --dump-dom "$URL" >"$TMP/dom.html" 2>"$TMP/chromium.log" ||
    fail "chromium --dump-dom failed: $(tail -5 "$TMP/chromium.log")"
HEIGHT="${SHOT_HEIGHT:-4200}"
timeout 120 "$CHROMIUM" "${FLAGS[@]}" --window-size="1400,$HEIGHT" \
    --screenshot="$OUTDIR/report.png" "$URL" >>"$TMP/chromium.log" 2>&1 ||
    fail "chromium --screenshot failed: $(tail -5 "$TMP/chromium.log")"
[[ -s "$OUTDIR/report.png" ]] || fail "chromium wrote no screenshot"

# 5. The checks, on the DOM as the browser built it.
step "checking the rendered DOM"
python3 - "$TMP/dom.html" <<'EOF' || fail "the rendered page is missing plots (see above)"
import html.parser, re, sys

class Plots(html.parser.HTMLParser):
    """Per data-plot SVG: its drawn marks (lines with points, data rects)."""
    def __init__(self):
        super().__init__()
        self.stack, self.plots, self.network = [], {}, []
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href", "xlink:href"):
            if re.match(r"\s*(https?:)?//", a.get(k) or ""):
                self.network.append(f"<{tag} {k}={a[k]}>")
        if tag == "svg" and "data-plot" in a:
            self.plots.setdefault(a["data-plot"], {"lines": 0, "rects": 0})
            self.stack.append(a["data-plot"])
        elif self.stack:
            p = self.plots[self.stack[-1]]
            if tag in ("polyline", "path") and len((a.get("points") or a.get("d") or "").split()) >= 2:
                p["lines"] += 1
            if tag == "rect" and self.in_group:
                p["rects"] += 1
            if tag == "g":
                self.in_group = True
    in_group = False
    def handle_endtag(self, tag):
        if tag == "g":
            self.in_group = False
        if tag == "svg" and self.stack:
            self.stack.pop()

text = open(sys.argv[1], encoding="utf-8").read()
p = Plots()
p.feed(text)
bad = []
for name, need in (("scaling", "lines"), ("busbw", "lines"), ("steps", "lines"), ("timeline", "rects")):
    got = p.plots.get(name)
    if got is None:
        bad.append(f'no <svg data-plot="{name}"> in the rendered page')
    elif got[need] == 0:
        bad.append(f'<svg data-plot="{name}"> has no {need} drawn')
    else:
        print(f"   {name:9} ok: {got['lines']} lines, {got['rects']} data rects")
if p.network:
    bad.append("network references: " + ", ".join(p.network[:5]))
if re.search(r"<script|<link|@import|url\(", text, re.I):
    bad.append("the page has a script, a link, an @import or a url(): it must be self-contained")
for b in bad:
    print("   MISSING:", b, file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

# The record of how it was made.
case "$BRAID" in
*/release/*) BUILD="a release build" ;;
*/debug/*) BUILD="a debug build: the bandwidths and step times are a debug build's" ;;
*) BUILD="$BRAID" ;;
esac
cat >"$OUTDIR/README.md" <<EOF
# \`braid report --html\` rendered in headless Chromium

Made by \`scripts/report-html/check.sh\` on $(date -u +"%Y-%m-%d %H:%M UTC") ($(uname -m), $(nproc) cores).

- \`report.html\`: the page, self-contained (inline CSS and SVG, no scripts, nothing fetched).
- \`report.png\`: its screenshot, 1400 px wide, by $VERSION ($INSTALLED).

Commands, in a temporary directory (\`braid\`: $BUILD):

\`\`\`
braid train --nproc 2 --steps 8 --trace tr2
braid train --nproc 1 --steps 8 --trace tr1
braid bench all_reduce --np 2 -b 1K -e 4M --backend shm --json shm.json
braid bench all_reduce --np 2 -b 1K -e 4M --backend tcp --json tcp.json
braid report tr2 --compare tr1 --bench shm.json --bench tcp.json --html report.html
chromium ${FLAGS[*]} --dump-dom file://.../report.html
chromium ${FLAGS[*]} --window-size=1400,$HEIGHT --screenshot=report.png file://.../report.html
\`\`\`

The check: in the DOM Chromium rendered, each of \`<svg data-plot="scaling|busbw|steps|timeline">\`
is present and draws something (polylines; the timeline's interval rects), and no element
refers to the network.
EOF
step "ok: $OUTDIR/report.html, $OUTDIR/report.png, $OUTDIR/README.md"
