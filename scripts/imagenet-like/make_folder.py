"""Builds a small ImageNet-like JPEG folder offline, for benchmarking image
loaders (braid vs ffcv vs torch's DataLoader).

    python make_folder.py OUT_DIR [--images 6000] [--classes 100] [--seed 0]
                          [--quality 90] [--workers N] [--force]

Layout (what torchvision.datasets.ImageFolder(OUT_DIR/train) reads):

    OUT_DIR/train/n00000017/n00000017_123.JPEG

Sources are real photographs that ship inside installed packages, so nothing
is downloaded: scikit-image's `skimage.data` (only the ones bundled in the
wheel; the pooch-fetched ones are skipped) and scikit-learn's
`load_sample_images()` (china.jpg, flower.jpg). Grayscale photos are turned
into RGB with a light class-dependent tint.

Each image: a source picked from the class's sources (seeded), a random crop
(10-100% of the source's area, aspect 3:4 to 4:3), a random horizontal flip,
a colour jitter (a per-class offset plus a small per-image part: brightness,
contrast, saturation, hue), a resize to an ImageNet-like size (longer side
300-500 with a spike at 500, aspect 4:3 / 3:2 / 1:1 / 3:4 / 2:3, mostly
landscape), a camera-like finish (unsharp mask, light sensor grain: the
sources are small and smooth, and without it files come out ~30 KB instead of
ImageNet's ~50 KB at q90), then JPEG at --quality with 4:2:0 chroma
subsampling (Pillow).

Every image draws from its own generator seeded by (seed, class, index), so
the output bytes do not depend on --workers or scheduling: the same seed gives
the same files (with the same Pillow/libjpeg build).
"""
import argparse
import io
import os
import shutil
import sys
import time
from multiprocessing import Pool

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

# skimage.data photographs that are bundled in the wheel (the others go
# through pooch and need the network). Synthetic images (binary_blobs,
# checkerboard, colorwheel, logo, shepp_logan_phantom, horse silhouette) and
# tiny ones (lfw_subset 25x25, microaneurysms 102x102) are left out; `cat` is
# the same picture as `chelsea`.
SKIMAGE_COLOUR = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
                  "immunohistochemistry", "retina", "motorcycle"]
SKIMAGE_GRAY = ["camera", "coins", "moon", "clock", "page", "text", "cell",
                "brick", "grass", "gravel"]

# ImageNet-like output shapes: (aspect w/h, weight). ImageNet's train set is
# dominated by 500x375, 500x333, 375x500 and 500x500.
ASPECTS = [(4 / 3, 0.45), (3 / 2, 0.35), (1.0, 0.04), (3 / 4, 0.10), (2 / 3, 0.06)]
LONG_500 = 0.2          # share of images whose longer side is exactly 500

# Camera-like finish, so that the upscaled crops of these (small, smooth)
# sources carry about as much detail per pixel as ImageNet photos: an unsharp
# mask and a little sensor grain (luma plus weaker chroma). Without them the
# mean file is ~30 KB instead of ~50 KB at q90.
SHARPEN_PERCENT = (100, 180)
SHARPEN_RADIUS = 1.5
GRAIN_SIGMA = (2.5, 5.5)


def load_sources():
    """Returns [(name, HxWx3 uint8 array, is_gray)] of every source that loads
    without the network."""
    import warnings
    import skimage.data as skd
    out = []
    for name in SKIMAGE_COLOUR + SKIMAGE_GRAY:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if name == "motorcycle":
                    a = skd.stereo_motorcycle()[0]   # left view of the stereo pair
                else:
                    a = getattr(skd, name)()
        except Exception as e:  # pooch-only file, or removed in this version
            print(f"skip skimage.data.{name}: {type(e).__name__}", file=sys.stderr)
            continue
        a = np.asarray(a)
        if a.dtype != np.uint8:
            a = (np.clip(a, 0, 1) * 255).astype(np.uint8) if a.dtype.kind == "f" else a.astype(np.uint8)
        gray = a.ndim == 2
        if gray:
            a = np.repeat(a[:, :, None], 3, axis=2)
        out.append(("skimage." + name, np.ascontiguousarray(a[:, :, :3]), gray))
    try:
        from sklearn.datasets import load_sample_images
        s = load_sample_images()
        for path, a in zip(s.filenames, s.images):
            out.append(("sklearn." + os.path.basename(path), np.ascontiguousarray(a), False))
    except Exception as e:
        print(f"skip sklearn sample images: {type(e).__name__}", file=sys.stderr)
    if not out:
        sys.exit("no source photos could be loaded")
    return out


def class_params(seed, c, n_sources):
    """Per-class choices: which sources it mostly draws from and its colour offset."""
    rng = np.random.default_rng([seed, 1, c])
    perm = rng.permutation(n_sources)
    return {
        "primary": int(perm[0]),
        "secondary": int(perm[1 % n_sources]),
        "brightness": float(rng.uniform(0.85, 1.15)),
        "contrast": float(rng.uniform(0.85, 1.2)),
        "saturation": float(rng.uniform(0.8, 1.3)),
        "hue": float(rng.uniform(-0.08, 0.08)),         # fraction of the hue circle
        "tint": rng.uniform(0.0, 1.0, 3),               # colour for grayscale sources
    }


_SOURCES = None


def _init_worker():
    global _SOURCES
    _SOURCES = load_sources()


def make_one(job):
    """job = (seed, class index, index in class, quality, out path).
    Returns (path, bytes, width, height, source index)."""
    seed, c, i, quality, path = job
    srcs = _SOURCES
    cp = class_params(seed, c, len(srcs))
    rng = np.random.default_rng([seed, 2, c, i])

    # Source: mostly the class's own, sometimes its second one, now and then any.
    r = rng.random()
    if r < 0.6:
        si = cp["primary"]
    elif r < 0.85:
        si = cp["secondary"]
    else:
        si = int(rng.integers(len(srcs)))
    _, arr, gray = srcs[si]

    # Output size: longer side 500 (LONG_500) or uniform 300..500, ImageNet-like aspect.
    ratios, weights = zip(*ASPECTS)
    aspect = ratios[int(rng.choice(len(ratios), p=np.array(weights) / sum(weights)))]
    long_side = 500 if rng.random() < LONG_500 else int(rng.integers(300, 501))
    if aspect >= 1:
        ow, oh = long_side, max(1, round(long_side / aspect))
    else:
        ow, oh = max(1, round(long_side * aspect)), long_side

    # Random crop: area 10-100% of the source, aspect in [3/4, 4/3] on the
    # output's side of 1 (to limit distortion), like RandomResizedCrop.
    H, W = arr.shape[:2]
    for _ in range(20):
        area = H * W * rng.uniform(0.10, 1.0)
        lo, hi = (1.0, 4 / 3) if aspect >= 1 else (3 / 4, 1.0)
        ca = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        cw, ch = int(round(np.sqrt(area * ca))), int(round(np.sqrt(area / ca)))
        if 0 < cw <= W and 0 < ch <= H:
            break
    else:
        cw, ch = min(W, H), min(W, H)
    x0 = int(rng.integers(0, W - cw + 1))
    y0 = int(rng.integers(0, H - ch + 1))
    crop = arr[y0:y0 + ch, x0:x0 + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    crop = np.ascontiguousarray(crop)

    # Grayscale photos: light class-coloured tint so they are not chroma-free.
    if gray:
        t = 0.75 + 0.25 * cp["tint"]                      # per-channel gain in [0.75, 1]
        crop = (crop.astype(np.float32) * (t / t.max())).astype(np.uint8)

    img = Image.fromarray(crop, "RGB").resize((ow, oh), Image.Resampling.BICUBIC)

    # Colour jitter: class offset times a small per-image part.
    def jit(base, spread):
        return base * float(rng.uniform(1 - spread, 1 + spread))
    img = ImageEnhance.Brightness(img).enhance(jit(cp["brightness"], 0.08))
    img = ImageEnhance.Contrast(img).enhance(jit(cp["contrast"], 0.08))
    img = ImageEnhance.Color(img).enhance(jit(cp["saturation"], 0.1))
    hue = cp["hue"] + float(rng.uniform(-0.02, 0.02))
    shift = int(round(hue * 256)) % 256
    if shift:
        h, s, v = img.convert("HSV").split()
        h = h.point(lambda x: (x + shift) % 256)
        img = Image.merge("HSV", (h, s, v)).convert("RGB")

    # Camera-like finish: sharpening and grain.
    img = img.filter(ImageFilter.UnsharpMask(radius=SHARPEN_RADIUS,
                                             percent=int(rng.integers(*SHARPEN_PERCENT)),
                                             threshold=2))
    sigma = float(rng.uniform(*GRAIN_SIGMA))
    px = np.asarray(img, dtype=np.float32)
    px = px + rng.normal(0.0, sigma, (oh, ow, 1)).astype(np.float32) \
            + rng.normal(0.0, 0.3 * sigma, (oh, ow, 3)).astype(np.float32)
    img = Image.fromarray(np.clip(px + 0.5, 0, 255).astype(np.uint8), "RGB")

    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, subsampling=2, optimize=False)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return path, len(data), ow, oh, si


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--images", type=int, default=6000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--force", action="store_true",
                    help="delete OUT_DIR/train first if it exists")
    a = ap.parse_args()
    if a.classes < 1 or a.images < a.classes:
        sys.exit("need --classes >= 1 and --images >= --classes")

    train = os.path.join(a.out_dir, "train")
    if os.path.exists(train) and os.listdir(train):
        if not a.force:
            sys.exit(f"{train} exists and is not empty (use --force to replace it)")
        shutil.rmtree(train)

    jobs = []
    per, extra = divmod(a.images, a.classes)
    for c in range(a.classes):
        cls = f"n{c:08d}"
        os.makedirs(os.path.join(train, cls), exist_ok=True)
        for i in range(per + (c < extra)):
            jobs.append((a.seed, c, i, a.quality, os.path.join(train, cls, f"{cls}_{i}.JPEG")))

    names = [s[0] for s in load_sources()]
    t0 = time.time()
    sizes, ws, hs, used = [], [], [], {}
    with Pool(max(1, a.workers), initializer=_init_worker) as pool:
        for k, (_, nbytes, w, h, si) in enumerate(pool.imap_unordered(make_one, jobs, chunksize=16), 1):
            sizes.append(nbytes); ws.append(w); hs.append(h)
            used.setdefault(si, []).append(nbytes)
            if k % 100 == 0 or k == len(jobs):
                el = time.time() - t0
                print(f"\r{k}/{len(jobs)} images  {el:6.1f}s  {k / max(el, 1e-9):6.0f} img/s",
                      end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    el = time.time() - t0

    sizes = np.array(sizes)
    print(f"wrote {len(sizes)} JPEGs in {a.classes} classes to {train} in {el:.1f}s "
          f"({a.workers} workers)")
    print(f"file size: mean {sizes.mean() / 1e3:.1f} KB, median {np.median(sizes) / 1e3:.1f} KB, "
          f"min {sizes.min() / 1e3:.1f} KB, max {sizes.max() / 1e3:.1f} KB, "
          f"total {sizes.sum() / 1e6:.1f} MB")
    print(f"dimensions: mean {np.mean(ws):.0f}x{np.mean(hs):.0f} (WxH), "
          f"mean pixels {np.mean(np.array(ws) * np.array(hs)) / 1e3:.0f}k")
    print("sources: images drawn from each, their mean JPEG size")
    for si, name in enumerate(names):
        b = used.get(si, [])
        print(f"  {name:34s} {len(b):5d}  {np.mean(b) / 1e3 if b else 0:5.1f} KB")


if __name__ == "__main__":
    main()
