// Appended to a copy of a Snakemake report by tests/test_report.py and run in headless chromium.
// It uses the report like a reader: clicks each category in the menu, then each result's view
// (eye) button, waits for the image the app shows and measures it (natural size, distinct
// colours drawn on a canvas). The findings go, as JSON, into a pre element with the id
// render-check, for --dump-dom.
// Finally it opens the result named by the URL fragment (#show=<file name>) for --screenshot.
(async () => {
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const out = { menu: [], shown: {}, errors: [] };
  const show = new URLSearchParams(location.hash.slice(1)).get("show"); // read now: links to "#" replace it
  const menuItem = (text) => [...document.querySelectorAll("#app a")].find((a) => a.textContent.trim() === text);
  const viewButtons = () => [...document.querySelectorAll("#app div[role=group] > a:first-child")];

  async function shownImage() {
    // the <img> the app displays for the selected result (global `app` and `results` of the report)
    const entry = results[app.state.resultPath];
    const img = entry && [...document.querySelectorAll("#app img")].find((i) => i.getAttribute("src") === entry.data_uri);
    if (img && !img.complete) await new Promise((resolve) => { img.onload = resolve; img.onerror = resolve; });
    return img;
  }

  function distinctColours(img) {
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    if (!canvas.width || !canvas.height) return 0;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(img, 0, 0);
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    const seen = new Set();
    for (let i = 0; i < px.length && seen.size < 1000; i += 4) seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
    return seen.size;
  }

  try {
    await sleep(500);
    for (const category of Object.keys(categories)) {
      const item = menuItem(category);
      if (!item) { out.errors.push(`no menu item for category ${category}`); continue; }
      out.menu.push(category);
      item.click();
      await sleep(300);
      for (const button of viewButtons()) {
        button.click();
        await sleep(300);
        const img = await shownImage();
        if (!img) { out.errors.push(`no image shown for ${app.state.resultPath} (${category})`); continue; }
        out.shown[app.state.resultPath] = {
          category,
          width: img.naturalWidth,
          height: img.naturalHeight,
          displayed_width: img.width,
          colours: distinctColours(img),
        };
      }
      document.querySelector("#app nav li:first-child a").click(); // the home breadcrumb: back to the menu
      await sleep(300);
    }
    const path = show && Object.keys(results).find((p) => p.endsWith("/" + show));
    if (path) {
      const category = Object.keys(categories).find((c) => Object.values(categories[c]).some((ps) => ps.includes(path)));
      menuItem(category).click();
      await sleep(300);
      const row = [...document.querySelectorAll("#app tr")].find((tr) => tr.textContent.includes(results[path].labels.figure));
      row.querySelector("div[role=group] > a:first-child").click();
      await sleep(300);
      out.finally_shown = app.state.resultPath;
    }
  } catch (e) {
    out.errors.push(String(e && e.stack ? e.stack : e));
  }
  const pre = document.createElement("pre");
  pre.id = "render-check";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
